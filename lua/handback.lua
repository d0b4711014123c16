-- handback.lua: a process back on Redis after deciding calls without it
-- (the Local fallback) tells Redis of the calls it admitted that still count
-- in a window, at their own times, and reserves the quota for the replicas
-- that may still decide without Redis.
--
-- KEYS and ARGV as in lib.lua, with
-- ARGV[4]   the replicas the quota is divided among (Options.ExpectedReplicas), n;
-- ARGV[5]   how long, in microseconds, other replicas may still decide
--           without Redis and their calls still count: until then Redis
--           admits only 1/n of each limit, the share no replica on the
--           fallback takes;
-- ARGV[6]   the number of charges;
-- after the rules, for each charge: the rule's index (from 1), the time of
-- the call in microseconds (for a concurrency slot still held, when its
-- lease ends; 0 or less when the process does not know Redis's clock: that
-- many microseconds from now, negated), its units, and its id. A call the
-- fallback booked ahead keeps its time, or the vendor would see it after
-- Redis had let it leave its windows.
--
-- Returns 1.

local now = clock()
local n, span, ncharges = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local rs = rules()
margins(rs, 0)
local meta = read_meta() or new_meta(now)
if now + span > meta.reserved_until then
  meta.reserved_until, meta.reserved_share = now + span, n
  write_meta(meta, rs)
end
local arg = after_rules()
for _ = 1, ncharges do
  local r = rs[tonumber(ARGV[arg])]
  local at, units, id = tonumber(ARGV[arg + 1]), tonumber(ARGV[arg + 2]), ARGV[arg + 3]
  arg = arg + 4
  if at <= 0 then
    at = now - at
  end
  if r and r.kind == CONCURRENCY then
    -- A slot still held: taken until its lease ends (at).
    zadd(r.key, str(at), id, 1, units)
    expire(r.key, (at - now) / 1000)
  elseif r then
    change(r, id, 0, units, at, now)
  end
end
return 1
