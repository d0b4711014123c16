-- handback.lua: a process back on Redis after deciding calls without it
-- (the Local fallback) tells Redis of the calls it admitted that still count
-- in a window, at their own times, and reserves the quota for the replicas
-- that may still decide without Redis.
--
-- KEYS and ARGV as in lib.lua; after the rules, ARGS.handback:
--   replicas  the replicas the quota is divided among (Options.ExpectedReplicas), n;
--   span      how long, in microseconds, other replicas may still decide
--             without Redis and their calls still count: until then Redis
--             admits only 1/n of each limit, the share no replica on the
--             fallback takes;
--   charges   the number of charges;
-- then for each charge ARGS.charge: the rule's index (from 1), the time of
-- the call in microseconds (for a concurrency slot still held, when its
-- lease ends; 0 or less when the process does not know Redis's clock: that
-- many microseconds from now, negated), its units, and its id. A call the
-- fallback booked ahead keeps its time, or the vendor would see it after
-- Redis had let it leave its windows.
--
-- Returns 1.

local now = clock()
local arg = after_rules()
local a
a, arg = ARGS.handback(arg)
local n, span = a.replicas, a.span
local rs = rules()
margins(rs, 0)
local meta = read_meta() or new_meta(now)
if now + span > meta.reserved_until then
  meta.reserved_until, meta.reserved_share = now + span, n
  write_meta(meta, rs)
end
for _ = 1, a.charges do
  local c
  c, arg = ARGS.charge(arg)
  local r, at, units, id = rs[c.rule], c.at, c.units, c.id
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
