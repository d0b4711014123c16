-- cancel.lua: give back the booking of a call that stopped waiting, so that the
-- slot goes to the next caller.
--
-- KEYS[i]   the sorted set of limit i, as passed to acquire.lua.
-- ARGV[1]   the call's id.
-- ARGV[2]   its cost: the booking holds members id.1 ... id.n (or id when n is 1).
--
-- Returns the number of members removed from all logs.

local id = ARGV[1]
local cost = tonumber(ARGV[2])
local members = {}
if cost == 1 then
  members[1] = id
else
  for u = 1, cost do
    members[u] = id .. '.' .. u
  end
end

local removed = 0
for i = 1, #KEYS do
  for k = 1, #members, 1000 do
    removed = removed + redis.call('ZREM', KEYS[i], unpack(members, k, math.min(k + 999, #members)))
  end
end
return removed
