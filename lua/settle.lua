-- settle.lua: replace a call's estimated cost by the cost the vendor
-- counted. The difference is refunded or charged at the call's slot. A
-- charge may fill a window past its limit: the vendor counted it already.
--
-- KEYS and ARGV as in lib.lua; after the rules, ARGS.settle: the booking
-- as acquire.lua answered for it (cost as admitted) and the actual cost.
-- A refund is told to the fleet (announce_room in lib.lua). Returns 1.

-- note_refund lists in r.key .. ':rf', for a window, the n units of call
-- id booked at t that rule r refunded now: the others' measure counts them.
local function note_refund(r, id, t, n, now)
  if OFF.others then
    return
  end
  local key = r.key .. ':rf'
  redis.call('ZREMRANGEBYSCORE', key, '-inf', str(now - r.window))
  redis.call('ZADD', key, str(now), str(t) .. ':' .. id .. ':' .. n)
  expire(key, r.window / 1000)
end

local now = clock()
local at = after_rules()
local b = ARGS.settle(at)
local id, from, t, to = b.id, read_cost(b.cost), b.slot, read_cost(b.actual)
local meta = read_meta()
-- Units of another epoch are gone with the data: only charged.
local stale = not meta or meta.epoch ~= b.epoch
local rs = rules()
margins(rs, 0)
local refunded = false
for _, r in ipairs(rs) do
  -- A call is one call whatever it cost: rules that count calls stay.
  local a, b = units(r, from), units(r, to)
  if r.kind ~= CONCURRENCY and not r.per_call and (b > a or b < a and not stale) then
    change(r, id, a, b, t, now)
    if b < a and r.kind ~= BUCKET then
      note_refund(r, id, t, a - b, now)
    end
    refunded = refunded or b < a
  end
end
if not stale then
  change_classes(rs, id, from, to, t, b, now)
end
if refunded then
  announce_room(meta, rs, t + longest_window(rs), now, function(r)
    return r.kind ~= CONCURRENCY and not r.per_call and math.max(units(r, from) - units(r, to), 0) or 0
  end)
end
return 1
