-- acquire.lua: admit or book one call against every limit of a quota, atomically.
--
-- Each limit is a sliding log: a sorted set whose members are admitted units and
-- whose scores are the times, in microseconds, at which they were admitted. A
-- unit may be booked in the future: a waiting call reserves the earliest time at
-- which it fits, and its caller sleeps until then. A call is recorded only when it
-- is admitted or booked; a refused call writes nothing.
--
-- KEYS[i]      the sorted set of limit i; all keys share the quota's hash tag.
-- ARGV[1]      now in microseconds, or "0" to read Redis TIME (the default, so the
--              whole fleet shares one clock).
-- ARGV[2]      the call's id, unique across the fleet. A call of cost n adds the
--              members id.1 ... id.n (or just id when n is 1).
-- ARGV[3]      cost: the units this call counts for.
-- ARGV[4]      the longest wait in microseconds the caller accepts; 0 admits only now.
-- ARGV[3+2i]   limit i: units allowed in any window.
-- ARGV[4+2i]   window i in microseconds, margin included.
--
-- Returns {admitted, wait, remaining, now}:
--   admitted   1 when the call was admitted (wait 0) or booked (wait > 0), else 0;
--   wait       microseconds from now until the call's slot; when refused, how long
--              until it would fit (its retry-after);
--   remaining  units still free now under the tightest limit;
--   now        the time the script used, in microseconds.
--
-- The script calls no redis.replicate_commands: since Redis 5 scripts replicate
-- their effects, and some hosted services reject the call.

local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local id = ARGV[2]
local cost = tonumber(ARGV[3])
local maxwait = tonumber(ARGV[4])

-- Scores are passed back to Redis as integers: Lua's tostring would print a
-- microsecond timestamp in exponent form and lose digits.
local function str(x)
  return string.format('%.0f', x)
end

-- earliest returns the earliest time >= t at which the new units fit in every
-- window of length w that would hold them, given the ascending scores s of one log
-- and r, the number of units such a window may already hold (limit - cost).
--
-- Any r+1 consecutive entries s[j] .. s[j+r] that lie within w of each other
-- forbid exactly the times in the open interval (s[j+r] - w, s[j] + w): a call
-- there would share one window with all of them. Those intervals start and end in
-- ascending order, so one pass finds the first allowed time. Future bookings count
-- like any other entry, so a freed booking can never let a window overfill, and a
-- gap between bookings is used when it is wide enough.
local function earliest(s, t, r, w)
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

-- Drop what has left every window, then load the logs that are too full to
-- admit the call without a look at their entries.
local logs = {}
local remaining = nil
for i = 1, #KEYS do
  local key = KEYS[i]
  local limit = tonumber(ARGV[3 + 2 * i])
  local w = tonumber(ARGV[4 + 2 * i])
  if cost > limit then
    return redis.error_reply('cost ' .. cost .. ' exceeds limit ' .. limit)
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', str(now - w))
  local n = redis.call('ZCARD', key)
  local log = { key = key, w = w, r = limit - cost }
  if n > log.r then
    local raw = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
    local s = {}
    for k = 2, #raw, 2 do
      s[#s + 1] = tonumber(raw[k])
    end
    log.s = s
  end
  logs[i] = log
  if remaining == nil or limit - n < remaining then
    remaining = limit - n
  end
end

-- The earliest time every log allows. Each log can only push the time later, and
-- only to one of finitely many entry-plus-window times, so this settles.
local t = now
local moved = true
while moved do
  moved = false
  for i = 1, #logs do
    local log = logs[i]
    if log.s then
      local u = earliest(log.s, t, log.r, log.w)
      if u > t then
        t = u
        moved = true
      end
    end
  end
end

local wait = t - now
if wait > maxwait then
  if remaining < 0 then
    remaining = 0
  end
  return { 0, str(wait), remaining, str(now) }
end

-- Record the call in every log. ZADD takes the units in chunks, since Lua's
-- unpack has a bounded stack.
local score = str(t)
for i = 1, #logs do
  local key = logs[i].key
  if cost == 1 then
    redis.call('ZADD', key, score, id)
  else
    local args = {}
    for u = 1, cost do
      args[#args + 1] = score
      args[#args + 1] = id .. '.' .. u
      if #args >= 1000 or u == cost then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
  end
  -- The key must outlive its latest entry by a window. An older, longer
  -- booking may already hold a later expiry: never shorten it.
  local ttl = math.ceil((t - now + logs[i].w) / 1000) + 1
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end

remaining = remaining - cost
if remaining < 0 or wait > 0 then
  remaining = 0
end
return { 1, str(wait), remaining, str(now) }
