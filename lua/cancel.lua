-- cancel.lua: give back the booking of a call that stopped waiting, so that
-- its slot goes to the next caller.
--
-- KEYS and ARGV as in lib.lua; after the rules, ARGS.cancel: the booking,
-- as acquire.lua answered for it. A booking of another epoch is gone with
-- the data it was written in, and nothing is given back.
--
-- The room it leaves is told to the fleet when calls are booked ahead
-- (announce_room in lib.lua).
--
-- Returns 1.

local now = clock()
local at = after_rules()
local b = ARGS.cancel(at)
local cost, t = read_cost(b.cost), b.slot
local meta = read_meta()
if not meta or meta.epoch ~= b.epoch then
  return 1
end
local rs = rules()
margins(rs, 0)
give_back(rs, b.id, cost, t, now)
change_classes(rs, b.id, cost, NONE, t, b, now)
announce_room(meta, rs, t + longest_window(rs), now, function(r) return units(r, cost) end)
return 1
