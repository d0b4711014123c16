-- cancel.lua: give back the booking of a call that stopped waiting, so that
-- its slot goes to the next caller.
--
-- KEYS and ARGV as in lib.lua, with
-- ARGV[4]   the time of the call's slot, in microseconds, as acquire.lua booked it;
-- ARGV[5]   the quota's epoch when it was booked: a booking of another epoch
--           is gone with the data it was written in, and nothing is given back;
-- ARGV[6]   where its class counted it, or "" (see change_classes in lib.lua).
--
-- The room it leaves is told to the fleet when calls are booked ahead
-- (announce_room in lib.lua).
--
-- Returns 1.

local now = clock()
local id = ARGV[2]
local cost = read_cost(ARGV[3])
local t = tonumber(ARGV[4])
local meta = read_meta()
if not meta or meta.epoch ~= tonumber(ARGV[5]) then
  return 1
end
local rs = rules()
margins(rs, 0)
give_back(rs, id, cost, t, now)
change_classes(rs, id, cost, NONE, t, ARGV[6], now)
announce_room(meta, rs, t + longest_window(rs), now)
return 1
