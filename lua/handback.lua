-- handback.lua: a process back from the Local fallback tells Redis of the
-- calls it admitted that still count, at their own times. It reserves the
-- quota for replicas still deciding without Redis (docs/PROTOCOL.md 6.8).
--
-- KEYS and ARGV as in lib.lua; after the rules, ARGS.handback: replicas,
-- n (Options.ExpectedReplicas); span, how long in µs others may still
-- decide without Redis, until when Redis admits 1/n of each limit; and
-- the number of charges. Then per charge, ARGS.charge: the rule's index
-- (from 1); the call's time in µs, for a concurrency slot its lease's end
-- (0 or less: that many µs from now, negated, when the process does not
-- know Redis's clock); its units; its id. Returns 1.

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
    zadd(r.key, str(at), id, 1, units)
    expire(r.key, (at - now) / 1000)
  elseif r then
    change(r, id, 0, units, at, now)
  end
end
return 1
