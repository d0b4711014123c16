-- release.lua: free a call's concurrency slots, or extend their lease.
--
-- KEYS and ARGV as in lib.lua; after the rules, ARGS.release: the call's
-- id, its cost, and 0 to release, else the new lease in µs from now.
-- Returns the number of units still held by the call (0 after a release).

local now = clock()
local at = after_rules()
local a = ARGS.release(at)
local id, cost, lease = a.id, read_cost(a.cost), a.lease
local held = 0
for _, r in ipairs(rules()) do
  if r.kind == CONCURRENCY then
    if lease == 0 then
      zrem(r.key, id, 1, units(r, cost))
    else
      for u = 1, units(r, cost) do
        held = held + redis.call('ZADD', r.key, 'XX', 'CH', str(now + lease), member(id, u))
      end
      expire(r.key, lease / 1000)
    end
  end
end
return held
