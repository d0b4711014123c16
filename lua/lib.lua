-- lib.lua: what every throttle script shares. It is prepended to each script,
-- so every script is one self-contained EVAL.
--
-- A quota is a list of rules, each kept in its own key. Every script that
-- touches rules receives them the same way:
--
-- KEYS[1]        the quota's meta key, "epoch:pause:refreshed": the time the
--                quota's data was first written (its epoch), a time before which
--                no call is admitted (set when the vendor answers 429), and when
--                the key's expiry was last pushed back.
-- KEYS[2]        the pause key of the call's key: a time before which no call
--                of that key is admitted; or KEYS[1] again.
-- KEYS[2+i]      the key of rule i.
-- ARGV[1]        now in microseconds, or "0" to read Redis TIME (the default, so
--                that the whole fleet shares one clock).
-- ARGV[2]        the call's id, unique across the fleet.
-- ARGV[3]        cost: the units this call counts for.
-- ARGV[4..6]     arguments of the script's own (see each script).
-- ARGV[3+4i]     rule i's kind: 1 sliding log, 2 sliding counter, 3 token bucket
--                (GCRA), 4 concurrency;
-- ARGV[4+4i] .. ARGV[6+4i]  its three parameters, by kind:
--                log:         limit, window (µs), unused
--                counter:     limit, window (µs), bucket width (µs)
--                bucket:      burst, emission interval per unit (µs), unused
--                concurrency: max, lease (µs), unused
--
-- No script calls redis.replicate_commands: since Redis 5 scripts replicate
-- their effects, and some hosted services reject the call.

local LOG, COUNTER, BUCKET, CONCURRENCY = 1, 2, 3, 4
local NEVER = math.huge

-- Redis receives times and counts as integers: Lua's tostring would print a
-- microsecond timestamp in exponent form and lose digits.
local function str(x)
  return string.format('%.0f', x)
end

local function clock()
  local now = tonumber(ARGV[1])
  if now == 0 then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return now
end

local function rules()
  local rs = {}
  for i = 1, #KEYS - 2 do
    local a = 3 + 4 * i
    rs[i] = {
      key = KEYS[2 + i],
      kind = tonumber(ARGV[a]),
      p1 = tonumber(ARGV[a + 1]),
      p2 = tonumber(ARGV[a + 2]),
      p3 = tonumber(ARGV[a + 3]),
    }
  end
  return rs
end

-- Unit u of call id is the member id (u = 1) or id.u: a call's units stay
-- unique across the fleet, and its first unit keeps the plain id.
local function member(id, u)
  if u == 1 then
    return id
  end
  return id .. '.' .. u
end

-- zadd adds units first .. last of call id at score, in chunks, since Lua's
-- unpack has a bounded stack.
local function zadd(key, score, id, first, last)
  local args = {}
  for u = first, last do
    args[#args + 1] = score
    args[#args + 1] = member(id, u)
    if #args >= 1000 or u == last then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
end

local function zrem(key, id, first, last)
  local args = {}
  for u = first, last do
    args[#args + 1] = member(id, u)
    if #args >= 1000 or u == last then
      redis.call('ZREM', key, unpack(args))
      args = {}
    end
  end
end

-- Every expiry gets this much slack, in milliseconds: Redis expires keys by
-- its own clock, which can differ from the time a script was given (the
-- client's clock, or a test's).
local SLACK = 1000

-- expire makes key live at least ms milliseconds: an older, longer booking
-- may already hold a later expiry, which must never be shortened.
local function expire(key, ms)
  ms = math.ceil(ms) + SLACK
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

-- The meta key lives META_TTL milliseconds after its last refresh, and is
-- refreshed about daily, so that an idle quota's meta key goes away.
local META_TTL = 30 * 24 * 3600 * 1000
local META_REFRESH = 24 * 3600 * 1000000

-- read_meta returns the quota's epoch (nil when the meta key is missing), its
-- pause, and when it was last refreshed.
local function read_meta()
  local v = redis.call('GET', KEYS[1])
  if v then
    local e, p, r = string.match(v, '^(%d+):(%d+):(%d+)$')
    if e then
      return tonumber(e), tonumber(p), tonumber(r)
    end
  end
  return nil, 0, 0
end

local function write_meta(epoch, pause, refreshed)
  redis.call('SET', KEYS[1], str(epoch) .. ':' .. str(pause) .. ':' .. str(refreshed), 'PX', META_TTL)
end

-- pause_until returns the time before which the call's scope is paused,
-- given the quota's own pause.
local function pause_until(quota_pause)
  local p = quota_pause
  if KEYS[2] ~= KEYS[1] then
    p = math.max(p, tonumber(redis.call('GET', KEYS[2]) or '0'))
  end
  return p
end

-- A token bucket is a hash: t, its theoretical arrival time in microseconds,
-- and id, the call that set it last.
local function tat_of(key)
  local v = redis.call('HMGET', key, 't', 'id')
  return tonumber(v[1] or '0'), v[2] or ''
end

local function set_tat(key, tat, id, now)
  if tat > now then
    redis.call('HSET', key, 't', str(tat), 'id', id)
    redis.call('PEXPIRE', key, math.ceil((tat - now) / 1000) + SLACK)
  else
    redis.call('DEL', key)
  end
end

-- Sliding counter helpers: the hash holds units per bucket index.
local function bucket_of(t, width)
  return math.floor(t / width)
end

-- change applies a change of units (positive: charge, negative: refund) to the
-- rule for the call id whose slot was at time t. Sliding counter, token bucket
-- and log rules change their count; a concurrency rule is not a count of units
-- over time, so only release.lua changes it.
local function change(r, id, from, to, t, now)
  if from == to then
    return
  end
  if r.kind == LOG then
    if to > from then
      zadd(r.key, str(t), id, from + 1, to)
      expire(r.key, (t - now + r.p2) / 1000)
    else
      zrem(r.key, id, to + 1, from)
    end
  elseif r.kind == COUNTER then
    local b = str(bucket_of(t, r.p3))
    if redis.call('HINCRBY', r.key, b, to - from) <= 0 then
      redis.call('HDEL', r.key, b)
    end
    expire(r.key, (t - now + r.p2 + r.p3) / 1000)
  elseif r.kind == BUCKET then
    local tat, last = tat_of(r.key)
    if to > from then
      -- A charge is safe whatever came before; it ends the chain, so no
      -- earlier call may refund after it.
      set_tat(r.key, math.max(tat, now) + (to - from) * r.p2, '', now)
    elseif last == id then
      -- Only the latest call can give units back: the bucket keeps one time,
      -- not a history, and taking an earlier call's units out of it would
      -- let a new call land on a later booking. Other refunds are dropped,
      -- which errs on the safe side.
      set_tat(r.key, tat - (from - to) * r.p2, to > 0 and id or '', now)
    end
  end
end
