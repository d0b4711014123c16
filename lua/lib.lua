-- lib.lua: what every throttle script shares, prepended to each script.
-- KEYS[1] is the meta key; KEYS[2] the call's pause key, or KEYS[1] again.
-- KEYS[2+i] is rule i's key; from KEYS[3+n] on come the other keys a script
-- may touch (declared in keys.go). A script touches no key outside KEYS.
-- ARGV[1] is now in µs, or "0" to read Redis TIME: the fleet shares a clock.
-- ARGV[2] is n, then n rules (ARGS.rule); the script's own layout starts at
-- after_rules(). ARGS.x(i) reads layout x from ARGV[i] by name. No script
-- calls redis.replicate_commands: some hosted services reject it
-- (docs/PROTOCOL.md 2, 2.1).

-- OFF names the mechanisms switched off for a measuring run (switches.go,
-- docs/PROTOCOL.md 7). It is empty in every other run.
local OFF = {}
local NEVER = math.huge

-- str writes a time or count as an integer: Lua's tostring would print a
-- µs timestamp in exponent form and lose digits.
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

-- rules returns the call's rules, each with its key, kind and flags, and
-- its parameters by name, in µs but limit (docs/PROTOCOL.md 2.1). limit is
-- a bucket's burst, or a concurrency rule's maximum; window includes the
-- configured margin; width is a counter's bucket width, interval a bucket's
-- per unit. shared is true for a rule every quota of the group shares.
local function rules()
  local rs, at = {}, 3
  for i = 1, tonumber(ARGV[2]) do
    local r
    r, at = ARGS.rule(at)
    local kind = r.kind
    r.i, r.key, r.kind = i, KEYS[2 + i], kind % PER_CALL
    r.per_call, r.per_key, r.shared = kind % PER_KEY >= PER_CALL, kind % SHARED >= PER_KEY, kind >= SHARED
    if r.kind ~= LOG and r.kind ~= COUNTER then
      r.window, r.width = nil, nil
    end
    if r.kind ~= BUCKET then
      r.interval = nil
    end
    if r.kind ~= CONCURRENCY then
      r.lease = nil
    end
    -- conf and conf_interval stay as configured: a learned cap (limits_in_force)
    -- and the Local fallback's reserve may lower limit and interval.
    r.conf, r.conf_interval = r.limit, r.interval
    rs[i] = r
  end
  return rs
end

-- read_cost reads a call's cost: one number for every rule, or for named
-- units (policies.Unit) one per rule, comma-separated. total is their sum.
local function read_cost(s)
  local n = tonumber(s)
  if n then
    return { all = n, total = n }
  end
  local per, total = {}, 0
  for x in string.gmatch(s, '[^,]+') do
    per[#per + 1] = tonumber(x)
    total = total + per[#per]
  end
  return { per = per, total = total }
end

-- units returns what a call of cost (read_cost) counts for under rule r:
-- its units there, or 1 under a rule that counts calls.
local function units(r, cost)
  if r.per_call and cost.total > 0 then
    return 1
  end
  return cost.per and cost.per[r.i] or cost.all
end

-- The place of the first argument after the rules.
local function after_rules()
  return 3 + ARGS.size.rule * tonumber(ARGV[2])
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

-- SLACK, in ms, is added to every expiry: Redis expires keys by its own
-- clock, which may differ from the time a script was given.
local SLACK = 1000

-- expire makes key live at least ms milliseconds: an older, longer booking
-- may already hold a later expiry, which must never be shortened.
local function expire(key, ms)
  ms = math.ceil(ms) + SLACK
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

-- The meta key lives META_TTL ms after its refresh (every META_REFRESH µs),
-- or twice the longest window: its absence must not look like a loss.
local META_TTL = 30 * 24 * 3600 * 1000
local META_REFRESH = 24 * 3600 * 1000000

-- The meta key is a hash of these fields, numbers but for lates, policies,
-- policy, rules and began; times are in µs, lists comma-separated:
--   epoch           when the quota's data was first written;
--   pause           no call of the quota is admitted before it;
--   refreshed       when the key's expiry was last pushed back;
--   period          the timing period (now // TIMING_PERIOD) lates is of;
--   spread          the fleet's spread in force (see note_timing);
--   lates           the period's latenesses: counts per LATE_BUCKETS bucket;
--   delay_max, delay_min  the period's longest and shortest usual delays;
--   prev_delay_max, prev_delay_min  the same in the period before, or -1;
--   loss            when Redis last lost the quota's data, or 0;
--   policies        the ids of the policies run lately, newest first;
--   reserved_until, reserved_share  until then, Redis admits only
--                   1/reserved_share of each limit (see handback.lua);
--   seq             the acquire scripts run in this epoch (see check_loss);
--   hold, hold_until  a spread held until then (see Holds);
--   next_hold, next_until  the hold that follows when hold_until passes;
--   caps_until      until then, a rule may have a cap or share (limits_in_force);
--   classes_until   until then, a rule may hold class shares (acquire.lua);
--   warm_until      the quota warms up until then (see Warming up);
--   warm_held       until then, the calls admitted at once while it warmed
--                   up are held;
--   paused_by       why pause was last set: one of PAUSED_BY_*, or 0;
--   policy          the newest policy's JSON description (describe.go);
--   policy_made     when the limiter that described it was made: an older
--                   one's does not replace it (describe in acquire.lua);
--   last_acquire    when the quota's last acquire script ran;
--   lost_by         why loss was set: PAUSED_BY_LOSS (0 reads so), or
--                   PAUSED_BY_CLOCK for a clock step;
--   rules           the ids of the newest policy's rules (check_policy);
--   began           "id=t,...": the rules a deploy added and when their
--                   data began, while they may be blind (see Blind rules);
--   counted         1 once an answer stated the vendor's counts (Scouts);
--   lag, lag_until  the answers' lag, and until when it holds (Answers' lag);
--   group_acquire   when the group's last acquire script ran (a group's
--                   quota only): it tells whose script first met a clock
--                   gone back, and drops what the shared rules hold ahead.
local META_FIELDS = {
  epoch = 0, pause = 0, refreshed = 0, period = -1, spread = 0,
  delay_max = -1, delay_min = -1, prev_delay_max = -1, prev_delay_min = -1,
  loss = 0, seq = 0, reserved_until = 0, reserved_share = 1,
  hold = 0, hold_until = 0, next_hold = 0, next_until = 0,
  caps_until = 0, warm_until = 0, warm_held = 0, last_acquire = 0,
  classes_until = 0, paused_by = 0, policy_made = 0, lost_by = 0, counted = 0,
  lag = 0, lag_until = 0, group_acquire = 0,
  -- Kept as text, '' when missing.
  policies = '', policy = '', rules = '', began = '',
}

-- paused_by is one of PAUSED_BY_* (consts.lua): the vendor, a clock gone
-- back (clock_back), or, with blind rules off, a loss or a new policy.

-- pause_for lengthens meta m's pause to until_, if later, noting why.
local function pause_for(m, until_, why)
  if until_ > m.pause then
    m.pause, m.paused_by = until_, why
  end
end

-- Groups. The quotas that declare a policies.Shared rule of one Name form a
-- group. Its key, "P:{Name}//group", holds the GROUP_FIELDS of every quota
-- of it, and names its channel. GROUP is built from the meta key: after the
-- tag, "/" marks a group's quota (docs/PROTOCOL.md 3.12).
local GROUP = not OFF.groups and KEYS[1] and string.match(KEYS[1], '^[^}]*}/')
if GROUP then
  GROUP = GROUP .. '/group'
end
local GROUP_FIELDS = {
  period = true, spread = true, lates = true, delay_max = true, delay_min = true,
  prev_delay_max = true, prev_delay_min = true, hold = true, hold_until = true,
  next_hold = true, next_until = true, warm_held = true, caps_until = true, classes_until = true,
  lag = true, lag_until = true, group_acquire = true,
}

-- group_raw holds the group key's fields as read_meta read them, or nil.
local group_raw

-- hash returns the fields of the hash at key, by name.
local function hash(key)
  local v = redis.call('HGETALL', key)
  local raw = {}
  for k = 1, #v, 2 do
    raw[v[k]] = v[k + 1]
  end
  return raw
end

-- home returns the fields, as read, of the key meta m keeps field f on:
-- the group's for a field of GROUP_FIELDS when the group was read.
local function home(m, f)
  if m.graw and GROUP_FIELDS[f] then
    return m.graw
  end
  return m.raw
end

-- meta_from sets the numbers of meta m, and its lates as text, from its
-- keys as read.
local function meta_from(m)
  for f, default in pairs(META_FIELDS) do
    local v = home(m, f)[f]
    if default == '' then
      m[f] = v or ''
    else
      m[f] = tonumber(v) or default
    end
  end
  m.lates_text = home(m, 'lates').lates or ''
  return m
end

-- read_meta returns the meta by field (missing ones as in META_FIELDS), or
-- nil when the key is missing. raw and graw keep the fields as read, so
-- write_meta writes only changes. With group, GROUP_FIELDS are read from
-- the group's key; cancel, settle and handback need none.
local function read_meta(group)
  if group and GROUP and not group_raw then
    group_raw = hash(GROUP)
  end
  local raw = hash(KEYS[1])
  local m = meta_from({ raw = raw, graw = group_raw })
  if not tonumber(raw.epoch) then
    return nil
  end
  return m
end

-- new_meta returns a new meta of the quota, the group's state kept.
local function new_meta(now)
  local m = meta_from({ raw = {}, graw = group_raw })
  m.epoch, m.refreshed = now, now
  return m
end

-- histogram returns the meta's histogram as a table of counts.
local function histogram(m)
  if not m.lates then
    m.lates = {}
    for x in string.gmatch(m.lates_text, '[^,]+') do
      m.lates[#m.lates + 1] = tonumber(x)
    end
  end
  return m.lates
end

-- write_meta writes the fields of meta m that changed, each to its key.
-- A new or refreshed key's expiry is pushed back (see META_TTL).
local function write_meta(m, rs)
  local args, gargs = {}, {}
  local function put(f, v)
    local a = home(m, f) == m.raw and args or gargs
    a[#a + 1], a[#a + 2] = f, v
  end
  for f, default in pairs(META_FIELDS) do
    if default == '' then
      if m[f] ~= (home(m, f)[f] or '') then
        put(f, m[f])
      end
    elseif tonumber(home(m, f)[f]) ~= m[f] then
      put(f, str(m[f]))
    end
  end
  if m.lates then
    local text = table.concat(m.lates, ',')
    if text ~= (home(m, 'lates').lates or '') then
      put('lates', text)
    end
  end
  if #args > 0 then
    redis.call('HSET', KEYS[1], unpack(args))
  end
  if #gargs > 0 then
    redis.call('HSET', GROUP, unpack(gargs))
  end
  local refreshed = m.raw.refreshed == nil or tonumber(m.raw.refreshed) ~= m.refreshed
  local group_new = #gargs > 0 and next(m.graw) == nil
  if refreshed or group_new then
    local ttl = META_TTL
    for _, r in ipairs(rs) do
      if r.kind == LOG or r.kind == COUNTER then
        ttl = math.max(ttl, 2 * r.window / 1000)
      end
    end
    if refreshed then
      redis.call('PEXPIRE', KEYS[1], math.ceil(ttl))
    end
    if m.graw then
      redis.call('PEXPIRE', GROUP, math.ceil(ttl))
    end
  end
end

-- Timing. Processes report how late after their slots, beyond their usual
-- delays, their calls started (timing.go): counts per lateness bucket.
-- Bucket 0 holds latenesses under 1 ms, bucket k those under 2^(k/2) ms.
-- The fleet's spread is their SPREAD_QUANTILE over a TIMING_PERIOD (µs).
-- It is raised within a period once SPREAD_SAMPLES calls show more
-- (docs/PROTOCOL.md 5.3, 5.4).
local TIMING_PERIOD = 2000000
local SPREAD_QUANTILE = 0.99
local SPREAD_SAMPLES = 50

-- bucket_top returns the top of bucket k, in microseconds; 0 for bucket 0:
-- a spread under a millisecond is none.
local function bucket_top(k)
  if k == 0 then
    return 0
  end
  return math.floor(1000 * 2 ^ (k / 2))
end

-- quantile returns the SPREAD_QUANTILE of histogram h, at the top of its
-- bucket, and the number of latenesses in it.
local function quantile(h)
  local total = 0
  for k = 1, LATE_BUCKETS do
    total = total + (h[k] or 0)
  end
  local want, seen = SPREAD_QUANTILE * total, 0
  for k = 1, LATE_BUCKETS do
    seen = seen + (h[k] or 0)
    if seen >= want and seen > 0 then
      return bucket_top(k - 1), total
    end
  end
  return 0, total
end

-- note_timing folds a process's report (ARGS.late list, or nil) and usual
-- delay (µs, or -1) into meta m. It reports whether m changed.
local function note_timing(m, now, report, delay)
  local p = math.floor(now / TIMING_PERIOD)
  local known = delay < 0 or m.period == p and delay <= m.delay_max and delay >= m.delay_min
  if not report and known and m.period >= p - 1 then
    return false
  end
  if m.period ~= p then
    -- A new period: after an idle one, or a warm-up's, spread and delays
    -- restart, since a warm-up's burst is not how the fleet runs.
    local q, n = quantile(histogram(m))
    if m.period == p - 1 and m.warm_until > m.period * TIMING_PERIOD then
      m.spread = 0
      m.prev_delay_max, m.prev_delay_min = -1, -1
    elseif m.period == p - 1 and n >= SPREAD_SAMPLES then
      m.spread = q
      m.prev_delay_max, m.prev_delay_min = m.delay_max, m.delay_min
    elseif m.period < p - 1 then
      m.spread = 0
      m.prev_delay_max, m.prev_delay_min = -1, -1
    end
    m.period, m.lates, m.delay_max, m.delay_min = p, {}, -1, -1
  end
  if delay >= 0 then
    if m.delay_max < 0 or delay > m.delay_max then
      m.delay_max = delay
    end
    if m.delay_min < 0 or delay < m.delay_min then
      m.delay_min = delay
    end
  end
  histogram(m)
  for _, late in ipairs(report or {}) do
    local k = math.min(late.bucket, LATE_BUCKETS - 1) + 1
    m.lates[k] = (m.lates[k] or 0) + late.n
  end
  for k = 1, LATE_BUCKETS do
    m.lates[k] = m.lates[k] or 0
  end
  local q, n = quantile(m.lates)
  if n >= SPREAD_SAMPLES and q > m.spread then
    m.spread = q
  end
  return true
end

-- fleet_spread returns the fleet's spread now in µs, 0 when unknown: the
-- calls' lateness, plus how much the processes' usual delays differ.
local function fleet_spread(m, now)
  if not m or m.period < math.floor(now / TIMING_PERIOD) - 1 then
    return 0
  end
  local dx, dn = m.delay_max, m.delay_min
  if m.prev_delay_max >= 0 then
    dx = math.max(dx, m.prev_delay_max)
    dn = dn < 0 and m.prev_delay_min or math.min(dn, m.prev_delay_min)
  end
  if dx >= 0 and dn >= 0 then
    return m.spread + dx - dn
  end
  return m.spread
end

-- Holds. When the spread falls, calls booked with its wider margins keep
-- their room until they have left their windows (docs/PROTOCOL.md 5.6).

-- roll_hold makes next_hold the hold once hold_until has passed. It
-- reports whether the meta changed.
local function roll_hold(m, now)
  if m.hold_until > now or m.next_until <= 0 or OFF.holds then
    return false
  end
  m.hold, m.hold_until, m.next_hold, m.next_until = m.next_hold, m.next_until, 0, 0
  return true
end

-- held_spread returns the widest spread earlier calls still hold, or 0.
local function held_spread(m, now)
  if not m or OFF.holds then
    return 0
  elseif m.hold_until > now then
    return m.hold
  elseif m.next_until > now then
    return m.next_hold
  end
  return 0
end

-- spread_in_force returns the widest spread a call may start with now.
local function spread_in_force(m, now)
  return math.max(fleet_spread(m, now), held_spread(m, now))
end

-- hold_spread holds spread, this script's calls' own, until the calls
-- booked up to slot have left the windows of rules rs. It reports whether
-- the meta changed.
local function hold_spread(m, now, spread, slot, rs)
  if spread <= 0 or OFF.holds then
    return false
  end
  local span = 0
  for _, r in ipairs(rs) do
    if r.kind == LOG or r.kind == COUNTER then
      span = math.max(span, r.window + r.margin)
    end
  end
  -- The widest spread held so far, or the next level after it.
  local s, u = 'hold', 'hold_until'
  if spread < m.hold and m.hold_until > now and not OFF.holds then
    s, u = 'next_hold', 'next_until'
  end
  local until_ = slot + span
  -- Pushed back in steps of a tenth of the span, to spare a write per call.
  if spread > m[s] or m[u] <= now or until_ > m[u] + span / 10 then
    if m[u] <= now or spread > m[s] then
      m[s] = spread
    end
    m[u] = math.max(m[u], until_ + span / 10)
    return true
  end
  return false
end

-- Margins. A log's margin grows from its configured one to twice the
-- fleet's spread, up to margin_ceiling (a tenth of the window, MAX_MARGIN
-- at most). A counter's never grows: it would cost a whole bucket. Neither
-- does one under GUARDED (docs/PROTOCOL.md 3.7).

-- Pacing. When the spread outgrows the widest margin, a log's calls that
-- may wait are booked r.pace (window / limit) from every entry (paced in
-- acquire.lua; docs/PROTOCOL.md 3.9).

local function margin_ceiling(r)
  if r.kind ~= LOG or r.margin < GUARDED then
    return r.margin
  end
  return math.max(r.margin, math.min(math.floor((r.window - r.margin) / 10), MAX_MARGIN))
end

-- Warming up. A quota new or idle warms up for its longest window: its
-- first calls open connections, and reach the vendor late. Until warm_held,
-- the margins keep room as for WARM_MARGIN (docs/PROTOCOL.md 5.7).

-- WARM_MARGIN (µs): a new connection's round trips across a continent.
local WARM_MARGIN = 200000

-- longest_window returns the longest window of rules rs: as configured
-- before margins runs, as in force after.
local function longest_window(rs)
  local span = 0
  for _, r in ipairs(rs) do
    if r.kind == LOG or r.kind == COUNTER then
      span = math.max(span, r.window)
    end
  end
  return span
end

-- starting reports whether the quota is new, or idle for longer than span
-- and WARM_IDLE: the vendor has then closed the fleet's connections.
local function starting(m, now, span)
  return not m or now - m.last_acquire > math.max(span, WARM_IDLE)
end

-- warm_hold returns how long (µs) the calls a warming quota admits at once
-- are held: the widest keep of rules rs. Call it after margins.
local function warm_hold(rs)
  local keep = 0
  for _, r in ipairs(rs) do
    if r.keep then
      keep = math.max(keep, r.keep)
    end
  end
  return keep
end

-- Answers' lag. A vendor's count comes the call's latency after its slot.
-- Each rule's record is kept that much longer (r.kept), or the others'
-- measure would count the fleet's calls that left it. The meta's lag, at
-- most the policy's longest window, holds LAG_HOLD windows. An answer that
-- comes while the record was kept for less measures nothing.
local LAG_HOLD = 8

-- note_lag makes meta m's lag hold an answer late µs after its slot (span:
-- the policy's longest window). A longer lag replaces it; one at least half
-- as long renews it once half its hold passed. It reports whether m changed.
local function note_lag(m, late, span, now)
  if not m or late <= 0 or span <= 0 or OFF.lag then
    return false
  end
  late = math.min(late, span)
  if late > m.lag or now >= m.lag_until then
    m.lag, m.lag_until = late, now + LAG_HOLD * span
    return true
  elseif 2 * late >= m.lag and m.lag_until - now < LAG_HOLD * span / 2 then
    m.lag_until = now + LAG_HOLD * span
    return true
  end
  return false
end

-- lag_of returns the lag meta m holds now, 0 for none.
local function lag_of(m, now)
  if not m or OFF.lag or now >= m.lag_until then
    return 0
  end
  return m.lag
end

-- margins sets, for each log and counter, r.margin and r.window in force.
-- r.keep is the widest the window may grow; r.kept how long its data is
-- kept (keep, or a tenth of the window more, plus lag). spread is the
-- fleet's, held the widest still held; warm says a warm-up's calls are
-- held. It returns the least guarded margin, a bucket's included, which a
-- call booked now is held to (late in waiter.go), or 0.
local function margins(rs, spread, held, warm, lag)
  if OFF.spread_margins then
    spread, held = 0, 0
  end
  local least = 0
  for _, r in ipairs(rs) do
    if r.kind == LOG or r.kind == COUNTER then
      local w, m = r.window - r.margin, r.margin
      local ceiling = margin_ceiling(r)
      if m >= GUARDED then
        local own = math.min(math.max(m, 2 * spread), ceiling)
        local old = math.min(math.max(m, 2 * math.max(spread, held or 0)), ceiling)
        if warm then
          old = math.max(old, math.min(ceiling, WARM_MARGIN))
        end
        if r.kind == LOG and ceiling > m and 2 * spread >= ceiling and not OFF.pacing then
          -- The fleet starts its calls later than the widest margin
          -- covers: pace the log's calls (see Pacing).
          r.pace = math.floor(w / r.limit)
        end
        m = math.ceil((own + old) / 2)
        if least == 0 or own < least then
          least = own
        end
      end
      r.margin, r.window, r.keep = m, w + m, w + ceiling
      r.kept = w + math.max(ceiling, math.min(math.floor(w / 10), MAX_MARGIN)) + (lag or 0)
    elseif r.kind == BUCKET and r.margin >= GUARDED and not OFF.bucket_margin then
      -- A bucket's margin does not grow, but its calls are held to it: a late
      -- one bunches with the calls after it at the vendor.
      if least == 0 or r.margin < least then
        least = r.margin
      end
    end
  end
  return least
end

-- Losses. A missing meta key means a new quota or a lost Redis; a caller
-- that knew an epoch tells them apart. From a loss on, every rule is blind
-- (docs/PROTOCOL.md 6.1).

-- loss_pause returns the end of a pause for a loss at time at: the longest
-- window of rs, or span, the policy's (feedback). Blind rules off only.
local function loss_pause(rs, at, span)
  return at + math.max(longest_window(rs), span or 0)
end

-- The functions of blind rules (see Blind rules, below).
local blind = {}

-- announce_lowered tells the fleet that a limit in force dropped now: calls
-- booked before book again at their slots (overtaken in Go). A shared
-- rule's drop is told to the group.
local function announce_lowered(m, now, shared)
  if m then
    local channel = shared and GROUP or KEYS[1]
    redis.call('PUBLISH', channel, NEWS.lowered .. ' ' .. str(m.epoch) .. ' ' .. str(now) .. ' ' .. str(now))
  end
end

-- blind.lost notes a loss at time at, for cause by: every rule is blind
-- from then. With blind rules off, the quota pauses instead.
function blind.lost(m, at, rs, span, by)
  m.loss, m.lost_by = at, by
  if OFF.blind_rules then
    pause_for(m, loss_pause(rs, at, span), by)
  end
  if GROUP then
    -- The group's shared rules were lost too: the calls its other quotas
    -- booked before book again at their slots, as after a drop (their
    -- processes may run no script till then; their own quota's news of
    -- the loss comes only from a script of that quota).
    announce_lowered(m, at, true)
  end
end

-- lose counts the data as lost now, under a new epoch, for cause by
-- (PAUSED_BY_LOSS when nil): sleeping calls book again.
local function lose(m, now, rs, by)
  m.epoch = now
  blind.lost(m, now, rs, nil, by or PAUSED_BY_LOSS)
end

-- check_loss finds a loss the caller did not know of (docs/PROTOCOL.md
-- 6.1, 6.2): m is the meta read (or nil), known the caller's epoch (or 0),
-- seen its count of the epoch's scripts (or nil), span as for loss_pause.
-- It returns the meta to use, whether it changed, and whether it found a
-- loss: a meta gone, an epoch the caller did not know began after a loss,
-- or a script count behind the caller's (a Redis gone back in time).
local function check_loss(m, now, known, rs, span, seen)
  if not m then
    m = new_meta(now)
    if known > 0 and not OFF.epochs then
      blind.lost(m, now, rs, span, PAUSED_BY_LOSS)
      return m, true, true
    end
    return m, true, false
  end
  if known <= 0 or OFF.epochs then
    return m, false, false
  end
  if known ~= m.epoch and m.loss < m.epoch then
    -- Lost before this epoch began: the fleet's calls since are in it.
    -- An epoch ahead of a clock gone back began by now at the latest.
    blind.lost(m, math.min(m.epoch, now), rs, span, PAUSED_BY_LOSS)
    return m, true, true
  end
  if seen and known == m.epoch and seen > m.seq then
    lose(m, now, rs)
    return m, true, true
  end
  return m, false, false
end

-- back_by returns time t, set before the clock went back by step, on the
-- new clock; a past time stays. The step counts from the last acquire, so
-- an idle quota's times move back less, and end no sooner than they should.
local function back_by(t, step, now)
  if t <= now then
    return t
  end
  return math.max(t - step, now)
end

-- clock_back returns how far the clock went back since meta m's last
-- acquire, when by over CLOCK_BACK µs (0 when it did not, or m is new),
-- and moves m's pause, set by the old clock, to the new one before any
-- loss is counted: check_meta counts the step as one, unless a loss was
-- found otherwise (a Redis gone back to an older copy, its clock too). A
-- smaller step only lengthens windows (docs/PROTOCOL.md 6.3).
local CLOCK_BACK = 5000
local function clock_back(m, now)
  if not m or m.last_acquire <= now + CLOCK_BACK or OFF.clock_steps then
    return 0
  end
  local step = m.last_acquire - now
  m.pause = back_by(m.pause, step, now)
  return step
end

-- announce_quota tells the quota's channel its epoch and pause (news.go).
local function announce_quota(m, now)
  redis.call('PUBLISH', KEYS[1], NEWS.quota .. ' ' .. str(m.epoch) .. ' ' .. str(m.pause) .. ' ' .. str(now))
end

-- booked_ahead reports whether a log or counter of rs holds units booked
-- after now. A counter is not read: it always says so.
local function booked_ahead(rs, now)
  for _, r in ipairs(rs) do
    if r.kind == COUNTER then
      return true
    elseif r.kind == LOG then
      local last = redis.call('ZRANGE', r.key, -1, -1, 'WITHSCORES')
      if last[2] and tonumber(last[2]) > now then
        return true
      end
    end
  end
  return false
end

-- ROOM_NAMES is how many processes at most the news of a log's room names,
-- ROOM_LOOK how many units past the room it reads. Told to all, a fleet of
-- hundreds would run hundreds of scripts per refund (docs/PROTOCOL.md 3.8).
local ROOM_NAMES, ROOM_LOOK = 8, 8

-- movers returns the limiter ids of the first calls booked after now in
-- the logs of rs that got units back (freed(r)). nil tells all: a counter
-- books no one by name, and feedback's room (freed nil) is a window's.
local function movers(rs, now, freed)
  if not freed or OFF.room_names then
    return nil
  end
  local names, seen = {}, {}
  for _, r in ipairs(rs) do
    local u = freed(r)
    if r.kind == COUNTER and u > 0 then
      return nil
    elseif r.kind == LOG and u > 0 then
      local first = redis.call('ZRANGEBYSCORE', r.key, '(' .. str(now), '+inf', 'LIMIT', 0, math.min(u, 256) + ROOM_LOOK)
      for _, m in ipairs(first) do
        local id = string.match(m, '^[^:]+')
        if id and not seen[id] then
          seen[id] = true
          names[#names + 1] = id
          if #names == ROOM_NAMES then
            return names
          end
        end
      end
    end
  end
  return names
end

-- announce_room tells the fleet that units given back left room up to
-- until_, so calls booked ahead move earlier (Limiter.moveEarlier in Go).
-- freed(r) is rule r's units back; nil for room any call may take. Room no
-- booking waits for is told to no one; a shared rule's goes to the group.
local function announce_room(m, rs, until_, now, freed)
  if until_ <= now or not m then
    return
  end
  local own, shared = {}, {}
  for _, r in ipairs(rs) do
    local list = GROUP and r.shared and shared or own
    list[#list + 1] = r
  end
  local channel = booked_ahead(shared, now) and GROUP or booked_ahead(own, now) and KEYS[1]
  if not channel then
    return
  end
  local msg = NEWS.room .. ' ' .. str(m.epoch) .. ' ' .. str(until_) .. ' ' .. str(now)
  local names = movers(rs, now, freed)
  if names and #names == 0 then
    return
  elseif names then
    msg = msg .. ' ' .. table.concat(names, ',')
  end
  redis.call('PUBLISH', channel, msg)
end

local function announce_key(until_, now)
  redis.call('PUBLISH', KEYS[1], NEWS.key .. ' ' .. KEYS[2] .. ' ' .. str(until_) .. ' ' .. str(now))
end

-- Blind rules. A rule is blind while the vendor may count calls its data
-- lacks: since a loss, or since the deploy that added it. Until since plus
-- its window, lease or burst span, it counts as full (a bucket as empty).
-- A vendor's count may rebuild it sooner for a key: <rule key>:rb holds when.

-- Scouts. While a log or counter is blind for a key, one call may go out
-- to learn where the vendor stands. It goes once blind.settled has passed,
-- from a process that heard the vendor's counts, or from any once the
-- meta's counted is set. Its answer rebuilds the rule (docs/PROTOCOL.md 6.1).

-- blind.id returns rule r's id, as compile in throttle.go names its key.
function blind.id(r)
  if r.id then
    return r.id
  end
  local base = string.sub(KEYS[1], 1, -5)
  local id = string.sub(r.key, #base + 1)
  if string.sub(r.key, 1, #base) ~= base then
    id = 'shared:' .. (string.match(r.key, '}//(.*)$') or r.key)
  end
  if r.per_key then
    id = string.match(id, '^(.*):[^:]*$') or id
  end
  r.id = id
  return id
end

-- blind.began returns, by rule id, when each rule a deploy added began, as
-- meta m keeps them (its began field), parsed once.
function blind.began(m)
  if not m.began_t then
    m.began_t = {}
    for id, t in string.gmatch(m.began, '([^,=]+)=(%d+)') do
      m.began_t[id] = tonumber(t)
    end
  end
  return m.began_t
end

-- blind.settled returns when the calls admitted before rule r's data began
-- have all reached the vendor: since plus the widest margin its window may
-- take. Call it after margins.
function blind.settled(r)
  if r.keep then
    return r.since + r.keep - (r.window - r.margin)
  end
  return r.since + r.margin
end

-- blind.span returns how long rule r stays blind from its since: a log's
-- or counter's window in force, a bucket's burst span, a lease.
function blind.span(r)
  if r.kind == LOG or r.kind == COUNTER then
    return r.window
  elseif r.kind == BUCKET then
    return r.limit * r.interval
  end
  return r.lease
end

-- blind.read sets r.since (0 when whole), r.blind_by (a PAUSED_BY_*),
-- r.blind_until and r.blind for rule r of meta m.
function blind.read(r, m, now)
  r.blind, r.since = false, m and m.loss or 0
  if OFF.blind_rules or not m then
    return
  end
  local began = m.began ~= '' and blind.began(m)[blind.id(r)] or 0
  r.blind_by = m.lost_by > 0 and m.lost_by or PAUSED_BY_LOSS
  if began > r.since then
    r.since, r.blind_by = began, PAUSED_BY_POLICY
  end
  if r.since <= 0 then
    return
  end
  r.blind_until = r.since + blind.span(r)
  if now >= r.blind_until then
    return
  end
  if r.kind ~= CONCURRENCY and not OFF.rebuild then
    if tonumber(redis.call('GET', r.key .. ':rb') or '0') >= r.since then
      -- Rebuilt from the vendor's count since its data began.
      r.since = 0
      return
    end
  end
  r.blind = true
end

-- blind.begin notes that the rules of rs new to the policy begin now, and
-- drops the notes of rules no longer blind or in it.
function blind.begin(m, now, rs)
  local known, began = {}, blind.began(m)
  for id in string.gmatch(m.rules, '[^,]+') do
    known[id] = true
  end
  local kept = {}
  for _, r in ipairs(rs) do
    local id = blind.id(r)
    local t = began[id]
    if not known[id] then
      t = now
    end
    if t and now < t + (r.keep or blind.span(r)) then
      kept[#kept + 1] = id .. '=' .. str(t)
    end
  end
  m.began, m.began_t = table.concat(kept, ','), nil
end

-- blind.ids returns the ids of rules rs, comma-separated.
function blind.ids(rs)
  local ids = {}
  for _, r in ipairs(rs) do
    ids[#ids + 1] = blind.id(r)
  end
  return table.concat(ids, ',')
end

-- check_policy notes that the quota runs under policy id, and reports
-- whether the meta changed. A deploy's new rules start blind; a new quota,
-- or a policy run lately, starts none (docs/PROTOCOL.md 6.4).
local function check_policy(m, now, id, rs, new)
  local ids = {}
  for x in string.gmatch(m.policies, '[^,]+') do
    if x == id then
      if m.rules == '' then
        -- A quota whose meta kept no rules yet: those of its policy.
        m.rules = blind.ids(rs)
        return true
      end
      return false
    end
    ids[#ids + 1] = x
  end
  if not new and #ids > 0 and not OFF.policy_ids then
    if OFF.blind_rules then
      pause_for(m, loss_pause(rs, now), PAUSED_BY_POLICY)
    else
      blind.begin(m, now, rs)
    end
  end
  m.rules = blind.ids(rs)
  table.insert(ids, 1, id)
  while #ids > 4 do
    table.remove(ids)
  end
  m.policies = table.concat(ids, ',')
  return true
end

-- pause_until returns when the call's scope is no longer paused, given the
-- quota's pause; key is the scope's pause key, KEYS[2] by default.
local function pause_until(quota_pause, key)
  local p = quota_pause
  key = key or KEYS[2]
  if key ~= KEYS[1] then
    p = math.max(p, tonumber(redis.call('GET', key) or '0'))
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

-- oldest_bucket returns the oldest bucket of counter r a window ending at t
-- touches: each counts in full (see earliest_counter in acquire.lua).
local function oldest_bucket(r, t)
  return bucket_of(t, r.width) - math.ceil(r.window / r.width)
end

-- bucket_free returns the units token bucket r has free at now, given tat.
local function bucket_free(r, tat, now)
  return math.floor((r.limit * r.interval - math.max(0, tat - now)) / r.interval)
end

-- A log's hint, in r.key .. ':next', is "t:at:c:w": with a window of w or
-- more, no time from t to at fits c more units. Added entries keep it
-- true; change lowers it when units are taken out (docs/PROTOCOL.md 3.2).
local function read_hint(r)
  if OFF.hint then
    return false
  end
  local v = redis.call('GET', r.key .. ':next')
  if v then
    local t, at, c, w = string.match(v, '^(%-?%d+):(%-?%d+):(%d+):(%d+)$')
    if t then
      return { t = tonumber(t), at = tonumber(at), c = tonumber(c), w = tonumber(w) }
    end
  end
  return false
end

local function write_hint(r, now)
  local h = r.hint
  if OFF.hint then
    return
  end
  redis.call('SET', r.key .. ':next', str(h.t) .. ':' .. str(h.at) .. ':' .. h.c .. ':' .. str(h.w),
    'PX', math.ceil((math.max(h.at, now) - now + r.keep) / 1000) + SLACK)
end

-- lower_hint makes the hint of log r say nothing after time t, for units
-- taken out at slot. For a slot past, it stays when the limit-th entry from
-- now lies within the hint's window of now: the hint is still true then.
local function lower_hint(r, t, slot, now)
  local h = read_hint(r)
  if not h or h.at <= t then
    return
  end
  if slot < now then
    local rank = redis.call('ZCOUNT', r.key, '-inf', '(' .. str(now)) + r.limit - 1
    local e = redis.call('ZRANGE', r.key, rank, rank, 'WITHSCORES')
    if e[2] and tonumber(e[2]) < now + h.w then
      return
    end
  end
  h.at = t
  r.hint = h
  write_hint(r, now)
end

-- change moves call id's units in rule r from `from` to `to`, at slot t.
-- A concurrency rule counts no units over time: release.lua changes it.
local function change(r, id, from, to, t, now)
  if from == to then
    return
  end
  if r.kind == LOG then
    if to > from then
      zadd(r.key, str(t), id, from + 1, to)
      expire(r.key, (t - now + r.keep) / 1000)
    else
      zrem(r.key, id, to + 1, from)
      -- Taking out units booked at t makes room only in windows holding t.
      lower_hint(r, t - r.keep, t, now)
    end
  elseif r.kind == COUNTER then
    local b = str(bucket_of(t, r.width))
    if redis.call('HINCRBY', r.key, b, to - from) <= 0 then
      redis.call('HDEL', r.key, b)
    end
    expire(r.key, (t - now + r.keep + r.width) / 1000)
  elseif r.kind == BUCKET then
    local tat, last = tat_of(r.key)
    if to > from then
      -- A charge is safe whatever came before; it ends the chain, so no
      -- earlier call may refund after it.
      set_tat(r.key, math.max(tat, now) + (to - from) * r.interval, '', now)
    elseif last == id then
      -- Only the latest call can give units back: the bucket keeps one time,
      -- not a history. Other refunds are dropped, on the safe side.
      set_tat(r.key, tat - (from - to) * r.interval, to > 0 and id or '', now)
    end
  end
end

-- give_back takes the units of call id, of cost, booked at t, out of every
-- rule of rs.
local function give_back(rs, id, cost, t, now)
  for _, r in ipairs(rs) do
    if r.kind == CONCURRENCY then
      zrem(r.key, id, 1, units(r, cost))
    else
      change(r, id, units(r, cost), 0, t, now)
    end
  end
end

-- Learned caps. A vendor may lower its cap without warning. When it
-- refuses a call as over its limit, the rules the refusal is about learn a
-- cap (learn_cap). After CAP_HOLD windows without a refusal, it rises by a
-- step that doubles each window (raise_caps; docs/PROTOCOL.md 3.10).

-- The cap of rule r is kept in r.key .. ':cap' as "lim:at:from:next:step":
--   lim   the limit in force, below the configured one (a bucket's: its
--         burst span's units, its rate falling with it);
--   at    when it last dropped;
--   from  the limit before that drop: refusals of calls decided before it
--         lower from there, so that they do not compound;
--   next  the earliest time it may rise;
--   step  how much it rises then.
-- The others' share follows; lim is then the configured limit if no cap.
local CAP_HOLD = 8
local CAP_FIRST_STEP = 16
local CAP_TTL = 24 * 3600 * 1000
local CAP_TTL_WINDOWS = 100

-- span_of returns the window the vendor counts a rule's limit over, as
-- configured: a window without its margin; a token bucket's burst span.
local function span_of(r)
  if r.kind == BUCKET then
    return r.conf * r.conf_interval
  end
  return r.window - r.margin
end

-- set_limit makes lim the limit in force of rule r.
local function set_limit(r, lim)
  lim = math.max(math.min(lim, r.conf), 1)
  if r.kind == BUCKET then
    r.interval = math.ceil(r.conf * r.conf_interval / lim)
  end
  r.limit = lim
end

-- Others' share. Other consumers of the vendor's key spend its limit too.
-- Each count measures them (note_others in feedback.lua), and the limit in
-- force leaves them their share (docs/PROTOCOL.md 3.11).
-- It follows the cap's five fields in ':cap', as ":vlim:i/top/sent,...":
--   vlim  the vendor's limit as it last stated it, 0 when unknown;
--   i     a period kept (see others_period);
--   top   its largest measure, in thousandths of a unit per window;
--   sent  the units the fleet had sent in the vendor's window then.
-- It is kept OTHERS_TTL windows after the last measure.
local OTHERS_PERIODS = 4
local OTHERS_KEPT = 6
local OTHERS_HELD = 16
local OTHERS_TTL = 8
local NO_MEASURE = -1000000000

-- others_period returns the period of time t for rule r, a table key:
-- past OTHERS_KEY_FLOOR, out of gopher-lua's array (docs/PROTOCOL.md 1.4).
local OTHERS_KEY_FLOOR = 2 ^ 27
local function others_period(r, t)
  return OTHERS_KEY_FLOOR + math.floor(t / math.max(math.floor(span_of(r) / OTHERS_PERIODS), 1))
end

-- others_share sets o.share, in thousandths of a unit per window, at time
-- t. It drops periods past OTHERS_KEPT, but keeps a steady share's (at most
-- an eighth of what the fleet sent) up to OTHERS_HELD, till the fleet is
-- seen busy again.
local function others_share(r, o, t)
  local cur, share, busy = others_period(r, t), NO_MEASURE, 0
  for i, p in pairs(o.p) do
    if i >= cur - OTHERS_KEPT and p >= 0 then
      busy = math.max(busy, o.sent[i] or 0)
    end
  end
  for i, p in pairs(o.p) do
    local sent = o.sent[i] or 0
    local held = i >= cur - OTHERS_HELD and not OFF.others_steady and 8 * p <= 1000 * sent and 10 * busy < 9 * sent
    if i < cur - OTHERS_KEPT and not held then
      o.p[i], o.sent[i] = nil, nil
    else
      share = math.max(share, p)
    end
  end
  o.share = share
end

-- others_reserve returns the units left to others of base, the vendor's
-- limit, from share o: 0 under a unit, else rounded up to a sixty-fourth
-- of base. A spare of a sixteenth and one, at most half the room left,
-- covers their jitter.
local function others_reserve(o, base)
  if not o or o.share < 1000 then
    return 0
  end
  local q = OFF.others_steady and 1 or math.max(math.floor(base / 64), 1)
  local share = math.min(math.ceil(o.share / 1000 / q) * q, base)
  return share + math.min(math.floor(share / 16) + 1, math.max(math.floor((base - share) / 2), 1))
end

-- apply_limits sets rule r's limit in force, the one place it is made:
-- the cap or configured limit, less r.reserve, what the vendor's limit
-- leaves others (r.spare the part of it beyond their share); then, given
-- `share` > 1 (the replicas that may still decide on the Local fallback),
-- 1/share of it, r.whole keeping the limit before (docs/PROTOCOL.md 3.10,
-- 3.11, 6.8).
local function apply_limits(r, share)
  local lim = r.cap and r.cap.lim or r.conf
  r.reserve, r.spare = 0, 0
  if r.oth and r.kind ~= BUCKET then
    local base = r.oth.vlim > 0 and r.oth.vlim or lim
    r.reserve = others_reserve(r.oth, base)
    r.spare = math.max(r.reserve - math.floor(r.oth.share / 1000), 0)
    lim = math.min(lim, base - r.reserve)
    if r.kind == LOG and r.reserve > 0 and lim > 0 and not OFF.others_pacing then
      -- Once half of it is in the window, calls that may wait are spread
      -- over it, and the vendor's counts with them (docs/PROTOCOL.md 3.11).
      r.share_pace = math.floor(3 * (r.window - r.margin) / (4 * lim))
    elseif r.kind == COUNTER and r.reserve > 0 and lim > 0 and not OFF.others_pacing then
      -- A counter's bucket then takes at most four thirds of its even share.
      r.share_per = math.ceil(4 * lim * r.width / (3 * r.window))
    end
  end
  set_limit(r, lim)
  if share then
    r.whole = { limit = r.limit, interval = r.interval }
    r.limit = math.max(math.floor(r.limit / share), 1)
    if r.kind == BUCKET then
      -- A share of the rate and of the burst: a longer interval alone
      -- would lengthen the burst's span with it.
      r.interval = r.interval * share
    end
  end
end

-- limits_in_force reads the learned caps and the others' shares of rules
-- rs, when the meta says some rule of the quota may have one, and sets
-- each rule's limit in force (apply_limits): with the Local fallback's
-- reserve unless whole. feedback.lua asks for the whole limits: the vendor
-- counts the fallback's calls too. It returns whether the reserve is in
-- force.
local function limits_in_force(rs, m, now, whole)
  local caps = m and m.caps_until > now
  local share = not whole and m and m.reserved_until > now and m.reserved_share > 1 and not OFF.reserve and m.reserved_share
  if not caps and not share then
    return false
  end
  for _, r in ipairs(rs) do
    if caps and r.kind ~= CONCURRENCY then
      local v = redis.call('GET', r.key .. ':cap')
      local lim, at, from, nxt, step, rest
      if v then
        lim, at, from, nxt, step, rest = string.match(v, '^(%d+):(%-?%d+):(%d+):(%-?%d+):(%d+)(.*)$')
      end
      if lim and tonumber(lim) < r.conf then
        r.cap = { lim = tonumber(lim), at = tonumber(at), from = tonumber(from), next = tonumber(nxt), step = tonumber(step) }
      end
      local vlim, periods = string.match(rest or '', '^:(%d+):(.*)$')
      if vlim and not OFF.others then
        local o = { vlim = tonumber(vlim), p = {}, sent = {} }
        for i, top, sent in string.gmatch(periods, '(%-?%d+)/(%-?%d+)/?(%d*)') do
          o.p[tonumber(i)], o.sent[tonumber(i)] = tonumber(top), tonumber(sent)
        end
        others_share(r, o, now)
        r.oth = o
      end
    end
    if r.cap or r.oth or share then
      apply_limits(r, share)
    end
  end
  return share and true or false
end

-- write_limits keeps rule r's cap and others' share, or drops the key when
-- it holds neither, and notes in meta m that the quota has some.
local function write_limits(r, m, now)
  if r.cap and r.cap.lim >= r.conf then
    r.cap = nil
  end
  apply_limits(r)
  if not r.cap and not r.oth then
    redis.call('DEL', r.key .. ':cap')
    return
  end
  local c = r.cap or { lim = r.conf, at = 0, from = r.conf, next = 0, step = 0 }
  local v = str(c.lim) .. ':' .. str(c.at) .. ':' .. str(c.from) .. ':' .. str(c.next) .. ':' .. str(c.step)
  local ttl = 0
  if r.cap then
    ttl = math.ceil(math.max(CAP_TTL, CAP_TTL_WINDOWS * span_of(r) / 1000))
  end
  if r.oth then
    local ps = {}
    for i, p in pairs(r.oth.p) do
      ps[#ps + 1] = str(i) .. '/' .. str(p) .. '/' .. str(r.oth.sent[i] or 0)
    end
    v = v .. ':' .. str(r.oth.vlim) .. ':' .. table.concat(ps, ',')
    ttl = math.max(ttl, math.ceil(OTHERS_TTL * span_of(r) / 1000))
  end
  redis.call('SET', r.key .. ':cap', v, 'PX', math.max(ttl, 1))
  m.caps_until = math.max(m.caps_until, now + ttl * 1000)
end

-- write_cap keeps rule r's cap c, or drops it when it has come back to the
-- configured limit.
local function write_cap(r, c, m, now)
  r.cap = c
  write_limits(r, m, now)
end

-- accepted_before returns the units the fleet admitted in the vendor's
-- window before time t, by rule r's record, or nil for a rule that keeps
-- none. A counter's buckets count for the part of them inside the window.
local function accepted_before(r, t)
  local w = span_of(r)
  if r.kind == LOG then
    return redis.call('ZCOUNT', r.key, '(' .. str(t - w), '(' .. str(t))
  elseif r.kind == COUNTER then
    local width, n = r.width, 0
    local raw = redis.call('HGETALL', r.key)
    for k = 1, #raw, 2 do
      local lo = tonumber(raw[k]) * width
      local inside = math.min(lo + width, t) - math.max(lo, t - w)
      if inside > 0 then
        n = n + tonumber(raw[k + 1]) * inside / width
      end
    end
    return math.floor(n)
  end
  return nil
end

-- learn_cap lowers rule r's cap after the vendor refused a call of n units
-- decided at as_of, and reports whether it dropped. A first refusal halves
-- the limit, unless the fleet had admitted more than it with the call.
-- A later one lowers it to what the fleet admitted before the call
-- (accepted_before); for a call decided before the last drop, from the
-- limit before it. vlimit is the limit the vendor stated, or 0. A drop
-- halves the limit at most (docs/PROTOCOL.md 3.10).
local function learn_cap(r, as_of, n, m, now, vlimit)
  if OFF.learned_caps then
    return false
  end
  local c = r.cap
  local lim, from
  if not c then
    if n > 0 and not OFF.first_cap and (accepted_before(r, as_of) or 0) + n > r.conf then
      -- The fleet's own record explains the refusal: with the call, the
      -- vendor's window held more than the configured limit (costs
      -- settled above their estimates, counted at the end).
      return false
    end
    lim, from = math.ceil(r.conf / 2), r.conf
  elseif as_of < c.at then
    lim, from = math.max(accepted_before(r, as_of) or 0, math.ceil(c.from / 2)), c.from
  else
    lim, from = math.max(accepted_before(r, as_of) or 0, math.ceil(c.lim / 2)), c.lim
  end
  if vlimit > 0 then
    lim = math.max(vlimit, math.ceil(from / 2))
  end
  lim = math.max(lim, 1)
  if not c and lim >= r.conf then
    -- The vendor's limit is the configured one: nothing to learn.
    return false
  end
  local hold = now + CAP_HOLD * span_of(r)
  if not c or lim < c.lim then
    write_cap(r, {
      lim = lim, at = now, from = from, next = hold,
      step = math.max(1, math.floor(lim / CAP_FIRST_STEP)),
    }, m, now)
    return true
  end
  -- Refused at the cap: it rose too far, or the vendor is still at it.
  c.next, c.step = math.max(c.next, hold), math.max(1, math.floor(c.lim / CAP_FIRST_STEP))
  write_cap(r, c, m, now)
  return false
end

-- raise_caps raises the caps of rules rs whose hold ended and whose window
-- the fleet fills (r.n). It reports whether a cap changed.
local function raise_caps(rs, m, now)
  local raised = false
  for _, r in ipairs(rs) do
    local c = r.cap
    if c and now >= c.next then
      local full
      if r.kind == BUCKET then
        full = r.tat - now > (r.limit - 1) * r.interval
      else
        full = r.n >= r.limit
      end
      if full then
        c.lim, c.next, c.step = c.lim + c.step, now + span_of(r), 2 * c.step
        write_cap(r, c, m, now)
        raised = true
      end
    end
  end
  return raised
end

-- Classes' bookings given back. A booking given back, or settled at another
-- cost, leaves its class's demand (':cl') and log too. Otherwise a call
-- that books again would count twice (docs/PROTOCOL.md 3.13).
local CLASS_PERIODS = 4

-- NONE is the cost of a booking given back.
local NONE = { all = 0, total = 0 }

-- A class's field of ':cl' lists its periods as "period:units:waited[/ahead]"
-- (ahead left out when 0): CLASS_PART reads one, class_part writes one.
local CLASS_PART = '(%-?%d+):(%d+):(%d+)/?(%d*)'

local function class_part(pi, u, w, a)
  return pi .. ':' .. u .. ':' .. w .. (a > 0 and '/' .. a or '')
end

-- class_period returns the period of time t for rule r.
local function class_period(r, t)
  return math.floor(t / math.max(math.floor(span_of(r) / CLASS_PERIODS), 1))
end

-- class_name returns the name of class, of priority prio, under rule r: a
-- rule per key counts priorities alone.
local function class_name(r, class, prio)
  if r.per_key then
    return str(prio)
  end
  return class
end

-- change_period changes by d the units class name booked in t's period
-- under rule r (never below 0), and its ahead too for a booking ahead.
local function change_period(r, name, t, d, ahead)
  local key = r.key .. ':cl'
  local v = redis.call('HMGET', key, name)[1]
  if not v then
    return
  end
  local want = class_period(r, t)
  local parts = {}
  for pi, u, w, a in string.gmatch(v, CLASS_PART) do
    a = tonumber(a) or 0
    if tonumber(pi) == want then
      u = math.max(tonumber(u) + d, 0)
      if ahead then
        a = math.max(a + d, 0)
      end
    end
    parts[#parts + 1] = class_part(pi, u, w, a)
  end
  redis.call('HSET', key, name, table.concat(parts, ','))
end

-- change_classes applies call id's change of cost, `from` to `to` (NONE
-- when given back), to its classes' logs and demand; part limits it to
-- 'logs' or 'demand'. where is the booking as acquire.lua answered it.
local function change_classes(rs, id, from, to, t, where, now, part)
  local noted, logged, ahead, class = where.noted, where.logged, where.ahead, where.class
  if noted == 0 or OFF.class_give_back then
    return
  end
  for _, r in ipairs(rs) do
    local bit = 2 ^ (r.i - 1)
    local a, b = units(r, from), units(r, to)
    if noted % (2 * bit) >= bit and a ~= b then
      local name = class_name(r, class, where.prio)
      if logged % (2 * bit) >= bit and part ~= 'demand' then
        local v = {}
        for k, x in pairs(r) do
          v[k] = x
        end
        v.key, v.hint = r.key .. ':c:' .. name, nil
        change(v, id, a, b, t, now)
      end
      if part ~= 'logs' then
        change_period(r, name, t, b - a, ahead)
      end
    end
  end
end
