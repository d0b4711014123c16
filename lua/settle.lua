-- settle.lua: replace the estimated cost a call was admitted with by the cost
-- the vendor counted (LLM tokens, GraphQL points), in the same windows: the
-- difference is refunded or charged at the call's slot, so that the shared
-- count matches the vendor's. A charge may fill a window past its limit: the
-- vendor has counted those units already, and later calls wait for them.
--
-- KEYS and ARGV as in lib.lua, with ARGV[3] the cost the call was admitted
-- with, and
-- ARGV[4]   the time of the call's slot, in microseconds;
-- ARGV[5]   the actual cost;
-- ARGV[6]   the quota's epoch when the call was admitted: the units of a call
--           of another epoch are gone with the data they were written in, so
--           they are not refunded, only charged.
--
-- A refund is told to the fleet when calls are booked ahead (announce_room
-- in lib.lua): their processes move them into the room it left.
--
-- Returns 1.

local now = clock()
local id = ARGV[2]
local from = tonumber(ARGV[3])
local t = tonumber(ARGV[4])
local to = tonumber(ARGV[5])
local meta = read_meta()
if (not meta or meta.epoch ~= tonumber(ARGV[6])) and to < from then
  return 1
end
local rs = rules()
margins(rs, 0)
for _, r in ipairs(rs) do
  -- A call is one call whatever it cost: rules that count calls stay.
  if r.kind ~= CONCURRENCY and not r.per_call then
    change(r, id, from, to, t, now)
  end
end
if to < from then
  announce_room(meta, rs, t + longest_window(rs), now)
end
return 1
