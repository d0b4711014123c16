-- cancel.lua: give back the booking of a call that stopped waiting, so that
-- its slot goes to the next caller.
--
-- KEYS and ARGV as in lib.lua, with
-- ARGV[4]   the time of the call's slot, in microseconds, as acquire.lua booked it.
--
-- Returns 1.

local now = clock()
local id = ARGV[2]
local cost = tonumber(ARGV[3])
local t = tonumber(ARGV[4])
for _, r in ipairs(rules()) do
  if r.kind == CONCURRENCY then
    zrem(r.key, id, 1, cost)
  else
    change(r, id, cost, 0, t, now)
  end
end
return 1
