-- acquire.lua: admit, book or refuse one call against every rule of a quota,
-- atomically. A call is recorded only when it is admitted or booked; a refused
-- call writes nothing.
--
-- KEYS and ARGV as in lib.lua, with
-- ARGV[4]   the longest wait in microseconds the caller accepts; 0 admits only now.
--
-- Returns {admitted, wait, remaining, now, reason, pause}:
--   admitted   1 when the call was admitted (wait 0) or booked (wait > 0), else 0;
--   wait       microseconds from now until the call's slot; when refused, how long
--              until it would fit (its retry-after);
--   remaining  units still free now under the tightest rule;
--   now        the time the script used, in microseconds;
--   reason     0 admitted, 1 refused: the slot lies beyond the wait accepted,
--              2 refused: a concurrency rule is full (no slot can be booked, since
--              no one knows when a holder will finish; wait is then the time until
--              the first lease runs out);
--   pause      the time until which the quota or the key is paused, or 0.

local now = clock()
local id = ARGV[2]
local cost = tonumber(ARGV[3])
local maxwait = tonumber(ARGV[4])

-- earliest_log returns the earliest time >= t at which the new units fit in
-- every window of length w that would hold them, given the ascending scores s
-- of a log and r, the number of units such a window may already hold.
--
-- Any r+1 consecutive entries s[j] .. s[j+r] that lie within w of each other
-- forbid exactly the times in the open interval (s[j+r] - w, s[j] + w): a call
-- there would share one window with all of them. Those intervals start and end
-- in ascending order, so one pass finds the first allowed time. Bookings ahead
-- count like any other entry, so a freed booking can never let a window
-- overfill, and a gap between bookings is used when it is wide enough.
local function earliest_log(s, t, r, w)
  for j = 1, #s - r do
    local a, b = s[j], s[j + r]
    if b - w >= t then
      return t
    end
    if b - a < w and t < a + w then
      t = a + w
    end
  end
  return t
end

-- earliest_counter returns the earliest time >= t at which the new units fit
-- a sliding counter. A window of length w that ends in bucket j may touch
-- buckets j-m .. j; each is counted in full, the partly expired one too, so no
-- window ever holds more than the limit. The units at t fall in bucket k and
-- into the windows ending in buckets k .. k+m, which must all have room.
local function earliest_counter(r, t)
  local width, limit = r.p3, r.p1
  local m = math.ceil(r.p2 / width)
  while true do
    local k = bucket_of(t, width)
    if k - m > r.last then
      return t -- every window from here on is empty
    end
    local sum = 0
    for x = k - m, k do
      sum = sum + (r.counts[x] or 0)
    end
    local fits = true
    for j = k, k + m do
      if j > k then
        sum = sum + (r.counts[j] or 0) - (r.counts[j - m - 1] or 0)
      end
      if sum + cost > limit then
        fits = false
        break
      end
    end
    if fits then
      return t
    end
    t = (k + 1) * width
  end
end

-- load drops what has left every window and reads what each rule needs to
-- decide; it also reports the units the rule has free now.
local function load(r)
  if r.kind == LOG then
    redis.call('ZREMRANGEBYSCORE', r.key, '-inf', str(now - r.p2))
    local n = redis.call('ZCARD', r.key)
    -- Only a log too full to take the call outright needs its entries read.
    if n > r.p1 - cost then
      local raw = redis.call('ZRANGE', r.key, 0, -1, 'WITHSCORES')
      r.s = {}
      for k = 2, #raw, 2 do
        r.s[#r.s + 1] = tonumber(raw[k])
      end
    end
    return r.p1 - n
  elseif r.kind == COUNTER then
    -- The oldest bucket a window ending now may touch, as earliest_counter
    -- counts them; older ones are gone for good.
    local oldest = bucket_of(now, r.p3) - math.ceil(r.p2 / r.p3)
    local raw = redis.call('HGETALL', r.key)
    r.counts, r.last = {}, -NEVER
    local used = 0
    for k = 1, #raw, 2 do
      local b, n = tonumber(raw[k]), tonumber(raw[k + 1])
      if b < oldest then
        redis.call('HDEL', r.key, raw[k])
      else
        r.counts[b] = n
        used = used + n
        if b > r.last then
          r.last = b
        end
      end
    end
    return r.p1 - used
  elseif r.kind == BUCKET then
    r.tat = tat_of(r.key)
    return math.floor((r.p1 * r.p2 - math.max(0, r.tat - now)) / r.p2)
  elseif r.kind == CONCURRENCY then
    redis.call('ZREMRANGEBYSCORE', r.key, '-inf', str(now))
    r.n = redis.call('ZCARD', r.key)
    return r.p1 - r.n
  end
  return redis.error_reply('unknown rule kind ' .. tostring(r.kind))
end

local function earliest(r, t)
  if r.kind == LOG then
    if r.s then
      return earliest_log(r.s, t, r.p1 - cost, r.p2)
    end
    return t
  elseif r.kind == COUNTER then
    return earliest_counter(r, t)
  elseif r.kind == BUCKET then
    -- GCRA: the call conforms once its units fit under the burst above the
    -- theoretical arrival time.
    return math.max(t, r.tat - (r.p1 - cost) * r.p2)
  else
    if r.n + cost <= r.p1 then
      return t
    end
    return NEVER
  end
end

local function record(r, t)
  if r.kind == LOG then
    zadd(r.key, str(t), id, 1, cost)
    expire(r.key, (t - now + r.p2) / 1000)
  elseif r.kind == COUNTER then
    redis.call('HINCRBY', r.key, str(bucket_of(t, r.p3)), cost)
    expire(r.key, (t - now + r.p2 + r.p3) / 1000)
  elseif r.kind == BUCKET then
    set_tat(r.key, math.max(r.tat, t) + cost * r.p2, id, now)
  else
    -- A concurrency slot is held from now, even for a booked call, until the
    -- call releases it or its lease runs out.
    zadd(r.key, str(t + r.p2), id, 1, cost)
    expire(r.key, (t - now + r.p2) / 1000)
  end
end

local rs = rules()
local remaining = NEVER
for _, r in ipairs(rs) do
  if r.p1 < cost then
    return redis.error_reply('cost ' .. cost .. ' exceeds limit ' .. r.p1)
  end
  remaining = math.min(remaining, load(r))
end
if remaining < 0 then
  remaining = 0
end

-- The earliest time every rule allows. Each rule can only push the time later,
-- and only to one of finitely many times, so this settles.
local pause = pause_until()
local t = math.max(now, pause)
local moved = true
while moved and t < NEVER do
  moved = false
  for _, r in ipairs(rs) do
    local u = earliest(r, t)
    if u > t then
      t = u
      moved = true
      if t == NEVER then
        break
      end
    end
  end
end

if t == NEVER then
  -- Hint at when a slot may free: the first lease to run out in each full
  -- concurrency rule, the latest of those.
  local hint = 0
  for _, r in ipairs(rs) do
    if r.kind == CONCURRENCY and r.n + cost > r.p1 then
      local head = redis.call('ZRANGE', r.key, 0, 0, 'WITHSCORES')
      hint = math.max(hint, tonumber(head[2]) - now)
    end
  end
  return { 0, str(hint), remaining, str(now), 2, str(pause) }
end

local wait = t - now
if wait > maxwait then
  return { 0, str(wait), remaining, str(now), 1, str(pause) }
end

for _, r in ipairs(rs) do
  record(r, t)
end
remaining = remaining - cost
if remaining < 0 or wait > 0 then
  remaining = 0
end
return { 1, str(wait), remaining, str(now), 0, str(pause) }
