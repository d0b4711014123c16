-- cancel.lua: give back the booking of a call that stopped waiting.
--
-- KEYS and ARGV as in lib.lua; after the rules, ARGS.cancel: the booking
-- as acquire.lua answered for it. Nothing is given back in another epoch,
-- whose data is gone. The fleet hears of the room (announce_room). Returns 1.

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
