-- usage.lua: read how full each rule of a quota is, changing nothing: no
-- trim, no expiry moved. A dashboard may run it as often as it likes.
-- KEYS and ARGV as in lib.lua: the time and the rules alone.
--
-- Returns REPLY.usage {now, pause, spread, epoch, paused_by, loss}, then for
-- each rule REPLY.rule {used, booked, remaining, next, margin, limit, others}:
--   spread     the fleet's spread of call starts (see note_timing in lib.lua);
--   epoch      the quota's epoch, or 0 for none;
--   pause      until when no call of the quota, or of the key, fits: the
--              vendor's pause or a blind rule's end, whichever is later;
--   paused_by  why (PAUSED_BY_* in lib.lua), or 0;
--   loss       when Redis was last found to have lost the quota's data, or 0;
--   used       units admitted in the window ending now;
--   booked     units booked for later by waiting calls;
--   remaining  units a call could take now (limit - used - booked, >= 0);
--   next       µs until one more unit fits, 0 when one fits now;
--   margin     the margin in force in µs (0 for a rule with none);
--   limit      the limit in force: the configured one or a learned cap
--              (limits_in_force in lib.lua), less the others' share;
--   others     the units per window it leaves the vendor's other consumers
--              (others_reserve in lib.lua).

local now = clock()
local meta = read_meta(true)
-- With no meta yet, a new one holds only the group's state, if any.
local state = meta or new_meta(now)
local spread = spread_in_force(state, now)
local rs = rules()
margins(rs, fleet_spread(state, now), held_spread(state, now), state.warm_held > now)
limits_in_force(rs, state, now)
local quota_pause = meta and meta.pause or 0
local pause = pause_until(quota_pause)
local paused_by = 0
if pause > now then
  -- A key's own pause comes from the vendor alone.
  paused_by = pause > quota_pause and PAUSED_BY_VENDOR or meta.paused_by
end
local out = {}

for _, r in ipairs(rs) do
  blind.read(r, meta, now)
  local used, booked, next = 0, 0, 0
  if r.kind == LOG then
    used = redis.call('ZCOUNT', r.key, '(' .. str(now - r.window), str(now))
    booked = redis.call('ZCOUNT', r.key, '(' .. str(now), '+inf')
    if used + booked >= r.limit then
      -- One unit fits once the oldest entry that counts has left its window.
      local first = redis.call('ZRANGEBYSCORE', r.key, '(' .. str(now - r.window), '+inf', 'WITHSCORES', 'LIMIT', used + booked - r.limit, 1)
      if first[2] then
        next = math.max(tonumber(first[2]) + r.window - now, 0)
      end
    end
  elseif r.kind == COUNTER then
    local k = bucket_of(now, r.width)
    local m = k - oldest_bucket(r, now)
    local raw = redis.call('HGETALL', r.key)
    local oldest = nil
    for i = 1, #raw, 2 do
      local b, n = tonumber(raw[i]), tonumber(raw[i + 1])
      if b > k then
        booked = booked + n
      elseif b >= k - m then
        used = used + n
        if n > 0 and (oldest == nil or b < oldest) then
          oldest = b
        end
      end
    end
    if used + booked >= r.limit and oldest then
      next = (oldest + m + 1) * r.width - now
    end
  elseif r.kind == BUCKET then
    local tat = tat_of(r.key)
    if r.since > 0 then
      tat = math.max(tat, r.since + r.limit * r.interval)
    end
    used = math.ceil(math.max(0, tat - now) / r.interval)
    next = math.max(0, tat - (r.limit - 1) * r.interval - now)
  else
    used = redis.call('ZCOUNT', r.key, '(' .. str(now), '+inf')
    if used >= r.limit then
      local first = redis.call('ZRANGEBYSCORE', r.key, '(' .. str(now), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      next = tonumber(first[2]) - now
    end
  end
  local remaining = math.max(r.limit - used - booked, 0)
  if r.blind and r.kind ~= BUCKET then
    -- Nothing fits until it sees again.
    remaining, next = 0, math.max(next, r.blind_until - now)
    if r.blind_until > pause then
      pause, paused_by = r.blind_until, r.blind_by
    end
  end
  local n = REPLY.usage.size + (r.i - 1) * REPLY.rule.size
  out[n + REPLY.rule.used], out[n + REPLY.rule.booked] = used, booked
  out[n + REPLY.rule.remaining], out[n + REPLY.rule.next] = remaining, str(next)
  out[n + REPLY.rule.margin] = str(r.kind ~= BUCKET and r.margin or 0)
  out[n + REPLY.rule.limit], out[n + REPLY.rule.others] = r.limit, r.reserve or 0
end
out[REPLY.usage.now], out[REPLY.usage.pause], out[REPLY.usage.spread] = str(now), str(pause), str(spread)
out[REPLY.usage.epoch], out[REPLY.usage.paused_by] = str(meta and meta.epoch or 0), paused_by
out[REPLY.usage.loss] = str(meta and meta.loss or 0)
return out
