-- lib.lua: what every throttle script shares. It is prepended to each script,
-- so every script is one self-contained EVAL.
--
-- A quota is a list of rules, each kept in its own key. Every script that
-- touches rules receives them the same way:
--
-- KEYS[1]        the quota's meta key (see read_meta): its epoch, a time before
--                which no call is admitted (set when the vendor answers 429), and
--                the fleet's timing as its processes report it.
-- KEYS[2]        the pause key of the call's key: a time before which no call
--                of that key is admitted; or KEYS[1] again.
-- KEYS[2+i]      the key of rule i, for n rules;
-- KEYS[3+n] ..   every other key the script may touch, declared (a rule's
--                hint, cap, charges, refunds, refusals and classes, the
--                group's key, the keys of a batch's other scopes: see
--                declared in keys.go); a script reaches them by name, and
--                touches no key not in KEYS.
--
-- ARGV follows the layouts of internal/protocol. ARGS.x(i) reads layout x
-- from ARGV[i] on, by name; lua.go folds it, and the other names consts.lua
-- lists, into the script as it loads it.
-- ARGV[1]        now in microseconds, or "0" to read Redis TIME (the default, so
--                that the whole fleet shares one clock).
-- ARGV[2]        n, the number of rules; then n rules (ARGS.rule, read by rules).
-- The script's own arguments start at after_rules(), in its layout.
--
-- No script calls redis.replicate_commands: since Redis 5 scripts replicate
-- their effects, and some hosted services reject the call.

-- OFF names the mechanisms turned off to measure again what they buy
-- (docs/PROTOCOL.md, section 7, and switches.go): empty but in such runs.
local OFF = {}
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

-- rules returns the rules of the call, each with its key, kind and
-- parameters by name:
--   limit     a log's or counter's limit, a bucket's burst, a concurrency
--             rule's maximum;
--   window    a log's or counter's window, its configured margin included;
--   width     a counter's bucket width;
--   interval  a bucket's emission interval per unit;
--   lease     a concurrency rule's lease;
--   margin    a log's or counter's configured margin, a bucket's own;
--   shared    true for a rule every quota of the group shares.
-- All times are in microseconds.
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
    -- The configured limit, or burst, and interval: a learned cap (see
    -- read_caps) and the Local fallback's reserve may lower limit and
    -- interval.
    r.conf, r.conf_interval = r.limit, r.interval
    rs[i] = r
  end
  return rs
end

-- read_cost reads a call's cost: one number, its units under every rule,
-- or, on a quota whose rules count units of several names (policies.Unit),
-- its units under each rule in the rules' order, comma-separated. total
-- is the sum of the numbers.
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

-- The meta key is refreshed about daily, and lives META_TTL milliseconds
-- after its last refresh, or twice the longest window of the quota if that
-- is longer: an idle quota's meta key goes away, but never while a window's
-- data may still be in Redis, lest its absence look like a loss.
local META_TTL = 30 * 24 * 3600 * 1000
local META_REFRESH = 24 * 3600 * 1000000

-- The meta key is a hash of these fields, each a number but policies and
-- lates:
--   epoch           when the quota's data was first written, in
--                   microseconds;
--   pause           a time before which no call of the quota is admitted;
--   refreshed       when the key's expiry was last pushed back;
--   period          the timing period (now // TIMING_PERIOD) lates is of;
--   spread          the fleet's spread in force (see note_timing);
--   lates           the histogram of the period's latenesses, comma-separated
--                   counts per LATE_BUCKETS bucket;
--   delay_max, delay_min
--                   the longest and shortest usual delay from Redis that the
--                   fleet's processes reported in the period;
--   prev_delay_max, prev_delay_min
--                   the same in the period before, or -1;
--   loss            when Redis was last found to have lost the quota's data,
--                   or 0;
--   policies        the ids of the policies the quota ran under lately,
--                   newest first, comma-separated (see check_policy);
--   reserved_until, reserved_share
--                   until then, Redis admits only 1/reserved_share of each
--                   limit: replicas of the Local fallback may still be
--                   deciding without Redis (see handback.lua);
--   seq             how many acquire scripts have run in this epoch: a Redis
--                   whose count is behind what a caller saw has gone back in
--                   time (see check_seq);
--   hold, hold_until
--                   a spread held until then: calls were booked with the
--                   margins it gave, and may start as late as those allow,
--                   so the margins keep room for them until they have all
--                   left their windows (see held_spread);
--   next_hold, next_until
--                   the same for the calls booked since the fleet's spread
--                   fell below hold, with the narrower margins it gave: the
--                   hold that follows when hold_until passes;
--   caps_until      until then, rules of the quota may have learned caps
--                   (see read_caps): before it, scripts read them; after it,
--                   they spare the reads;
--   classes_until   until then, rules of the quota may hold shares for
--                   classes of calls (see Classes in acquire.lua): before
--                   it, every call reads them; after it, only a call of a
--                   class does;
--   warm_until, warm_held
--                   until warm_until, the quota warms up; until warm_held,
--                   the calls it admitted at once while it did are held (see
--                   Warming up);
--   paused_by       why pause was last set: one of PAUSED_BY_*, or 0;
--   policy          the newest policy's description, as the process that
--                   runs it sent it (JSON: see description in describe.go),
--                   so that a tool reads the quota without being told its
--                   policy;
--   policy_made     when the limiter that described it was made (see
--                   describe in acquire.lua): an older one's does not
--                   replace it;
--   last_acquire    when the last acquire script of the quota ran;
--   lost_by         why loss was last set: PAUSED_BY_LOSS, or
--                   PAUSED_BY_CLOCK for a clock gone back (0 reads as a loss);
--   rules           the ids of the rules of the newest policy, comma-separated
--                   (see check_policy);
--   began           "id=t,...": the rules a deploy added, with when their
--                   data began, while they may still be blind (see Blind rules);
--   counted         1 once an answer of the vendor stated its counts
--                   (feedback.lua): every process's calls may go out as
--                   scouts, a process new since too (see Scouts).
local META_FIELDS = {
  epoch = 0, pause = 0, refreshed = 0, period = -1, spread = 0,
  delay_max = -1, delay_min = -1, prev_delay_max = -1, prev_delay_min = -1,
  loss = 0, seq = 0, reserved_until = 0, reserved_share = 1,
  hold = 0, hold_until = 0, next_hold = 0, next_until = 0,
  caps_until = 0, warm_until = 0, warm_held = 0, last_acquire = 0,
  classes_until = 0, paused_by = 0, policy_made = 0, lost_by = 0, counted = 0,
  lag = 0, lag_until = 0,
  -- Kept as text, '' when missing.
  policies = '', policy = '', rules = '', began = '',
}

-- Why the quota's pause was last set (the meta's paused_by) is one of
-- PAUSED_BY_* (consts.lua): feedback.lua's refusal or pause asked, a loss
-- (check_loss, lose), a new policy (check_policy), a clock gone back
-- (check_clock).

-- pause_for lengthens the quota's pause in meta m to until, if that is
-- later, noting why.
local function pause_for(m, until_, why)
  if until_ > m.pause then
    m.pause, m.paused_by = until_, why
  end
end

-- Groups. The quotas that declare a policies.Shared rule form a group,
-- named by its Name. Each keeps its meta key, but the state of what they
-- share is kept on one key of the group, which every quota of it reads and
-- writes: the fields of GROUP_FIELDS. The group's processes are one fleet
-- at the vendor: the spread of their calls sets the margin every quota
-- searches a shared log with, and the holds keep the margins that calls
-- of any quota were booked with. And every quota reads a shared rule's
-- learned cap, others' share and classes while any quota may have them.
-- The group's key is "P:{Name}//group", built from the meta key,
-- "P:{Name}/<quota>:meta" (a quota of no group has "P:{<quota>}:meta"):
-- after the tag, "/" marks a group. News about a shared rule goes to the
-- channel named as the group's key, which every quota of it listens to.
local GROUP = not OFF.groups and KEYS[1] and string.match(KEYS[1], '^[^}]*}/')
if GROUP then
  GROUP = GROUP .. '/group'
end
local GROUP_FIELDS = {
  period = true, spread = true, lates = true, delay_max = true, delay_min = true,
  prev_delay_max = true, prev_delay_min = true, hold = true, hold_until = true,
  next_hold = true, next_until = true, warm_held = true, caps_until = true, classes_until = true,
  lag = true, lag_until = true,
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

-- read_meta returns the meta as a table, its numbers by name (each
-- missing one as in META_FIELDS), or nil when the key is missing. The
-- fields as read are kept in raw (the group's in graw), so that
-- write_meta writes only those that changed; lates is kept as text
-- (lates_text) until a report needs it. With group, a quota of a group
-- takes the fields of GROUP_FIELDS from the group's key; a script that
-- reads none of them (cancel, settle, handback) spares the read.
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

-- write_meta writes the fields of the meta m that changed since it was
-- read, each to its key (see Groups); an expiry is pushed back when the
-- meta or the group's key is new, or the meta refreshed (see META_TTL),
-- for the longest window of rules rs.
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

-- Timing: each process reports, with its calls, how much later than its
-- usual delay its calls since its last report started after their slots
-- (see timing.go), as counts per bucket of lateness. Bucket 0 holds
-- latenesses under 1ms, bucket k those under 2^(k/2) ms. The fleet's spread
-- is the SPREAD_QUANTILE of the latenesses of all its calls over a period:
-- how much later after its slot one call may start than another, but for
-- the few that the late-start guard books again. It is computed when a
-- period ends, and raised during a period as soon as enough calls show more.
-- So one slow process among many widens the margin only as much as its
-- share of the calls, and a fleet that calms down narrows it within two
-- periods.
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

-- note_timing folds a process's report (a list of ARGS.late, the latenesses
-- n in bucket k, or nil for none; its usual delay from Redis, or -1) into
-- the meta, and reports whether it changed.
local function note_timing(m, now, report, delay)
  local p = math.floor(now / TIMING_PERIOD)
  local known = delay < 0 or m.period == p and delay <= m.delay_max and delay >= m.delay_min
  if not report and known and m.period >= p - 1 then
    return false
  end
  if m.period ~= p then
    -- A new period: the last one, if it saw enough calls, says the spread;
    -- a fleet idle for a period or more starts from nothing, and so does a
    -- fleet whose quota warmed up during the last one: what its calls
    -- measured then was the start's burst (connections opened, scripts
    -- answered at once), which the warm-up's margins and holds cover, not
    -- how the fleet runs. Its processes' usual delays too: each was read
    -- off the fastest of the replies of that burst, all of them held up in
    -- Redis's long turns. The spread rises again as soon as enough calls
    -- of the new period show it, and the delays as soon as the processes
    -- report them, with their next script calls.
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

-- fleet_spread returns the fleet's spread as of now, 0 when unknown: the
-- lateness of its calls beyond each process's usual delay, and how much the
-- usual delays of its processes differ.
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

-- Holds. A call booked with a margin may start as late as half of it (the
-- late-start guard), and the calls booked after it keep that margin from
-- it. So when the fleet's spread falls, the calls already booked with the
-- wider margins it gave keep their room: a new booking keeps from them half
-- its own margin and half theirs (see margins), which covers how late they
-- may start and how much the way to the vendor may differ now; and is
-- itself held to the narrower margin it was given. The widest spread still
-- held is hs, until hu; the calls booked since the spread fell below it
-- are held at ns, until nu, and take over when hu passes. A saturated
-- fleet, always booking a window ahead, so narrows its margins within two
-- windows of its spread falling, instead of never.

-- roll_hold ends the hold of hs once its calls have left their windows,
-- and reports whether the meta changed.
local function roll_hold(m, now)
  if m.hold_until > now or m.next_until <= 0 or OFF.next_hold then
    return false
  end
  m.hold, m.hold_until, m.next_hold, m.next_until = m.next_hold, m.next_until, 0, 0
  return true
end

-- held_spread returns the widest spread that calls booked earlier still
-- hold, 0 when none.
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

-- spread_in_force returns the widest spread a call of the fleet may start
-- with now: the fleet's, or a wider one still held for the calls booked
-- with it.
local function spread_in_force(m, now)
  return math.max(fleet_spread(m, now), held_spread(m, now))
end

-- hold_spread holds spread, the fleet's as the calls of this script were
-- booked with it, until the calls booked up to slot have left the windows
-- of rules rs, and the latest of them may have started. It reports whether
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
  if spread < m.hold and m.hold_until > now and not OFF.next_hold then
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

-- Margins. A window's margin absorbs the spread between the decision in
-- Redis and the arrival at the vendor. A log's configured margin is a floor:
-- when the fleet's spread needs more, the margin in force grows to twice the
-- spread (half of the margin for the start of calls, which the late-start
-- guard holds to it, half for the way to the vendor), up to a ceiling of a
-- tenth of the window, at most one second. A counter keeps its configured
-- margin: it counts whole buckets, far coarser than the spread, and a wider
-- margin would cost it a whole bucket of the quota. A margin under GUARDED
-- is a choice to run without one, and never grows.

-- Pacing. A saturated log admits each window's calls where the window
-- before admitted its calls, all at once when those came at once. A fleet
-- that cannot start so many calls at the same moment (a thousand small
-- replicas on a few cores; a Redis that answers a burst of scripts one at a
-- time) starts the last of them late, and its spread widens the margin.
-- Past the margin's ceiling, widening is no longer enough: a call that may
-- wait is then booked at least the log's average gap between calls
-- (window / limit) away from every entry of the log. A window's calls
-- spread over it, and the windows after it keep that spread, since each
-- call is booked a window after one before it; a saturated fleet admits no
-- fewer calls so (it can admit no more than a limit per window in force
-- anyway). The first burst so paced waits up to a window longer, once. A
-- narrower gap (a quarter of it was tried) leaves the calls in bursts at
-- that gap's rate, with the rest of each window empty, and starts them
-- later.
--
-- A quota warming up paces the lone calls of many replicas too (see
-- acquire.lua). A paced time may lie among the log's bookings (room left by
-- a booking given back, too close to its neighbours): the rules settle from
-- it within a short read, or else for the log's tail, paced once more.

local function margin_ceiling(r)
  if r.kind ~= LOG or r.margin < GUARDED then
    return r.margin
  end
  return math.max(r.margin, math.min(math.floor((r.window - r.margin) / 10), MAX_MARGIN))
end

-- Warming up. A fleet that starts calling a quota, new or idle for a
-- minute or a window, knows nothing yet of its spread, and its first calls
-- are the slowest to reach the vendor: each opens a connection (a TLS
-- handshake takes tens of milliseconds), while the calls a window later
-- find them open. So the quota warms up for its longest window: the calls
-- it admits at once meanwhile may reach the vendor as late as the widest
-- margin allows, up to WARM_MARGIN, and until they have left their windows
-- (wh), every log's margin in force keeps half that from them and half its
-- own margin, as for calls booked with a margin that wide (see margins).
-- The margins a call is held to, and pacing, still follow the spread
-- measured.

-- The margin the calls admitted at once while a quota warms up may take,
-- up to the ceiling: a new connection's DNS, TCP and TLS round trips to a
-- vendor across a continent.
local WARM_MARGIN = 200000

-- longest_window returns the longest window of rules rs: as configured
-- before margins widens them (how long a quota warms up), as in force
-- after.
local function longest_window(rs)
  local span = 0
  for _, r in ipairs(rs) do
    if r.kind == LOG or r.kind == COUNTER then
      span = math.max(span, r.window)
    end
  end
  return span
end

-- starting reports whether the fleet starts calling the quota now: it is
-- new, or no acquire script ran for longer than span or WARM_IDLE, after
-- which the vendor's window is empty and its servers have closed the
-- connections the fleet kept open.
local function starting(m, now, span)
  return not m or now - m.last_acquire > math.max(span, WARM_IDLE)
end

-- warm_hold returns how long the calls admitted at once while the quota
-- warms up are held: until the widest window they may be counted in has
-- passed. Read after margins.
local function warm_hold(rs)
  local keep = 0
  for _, r in ipairs(rs) do
    if r.keep then
      keep = math.max(keep, r.keep)
    end
  end
  return keep
end

-- Answers' lag. A vendor's count is measured against the fleet's record
-- of the vendor's window before the call's slot (sent_in_window in
-- feedback.lua), and the answer that brings it comes the call's latency
-- after the slot: an LLM's, seconds after. The record is kept that much
-- longer than its widest window (r.kept: a tenth of the window more, up
-- to MAX_MARGIN, as a log's margin may grow, and the lag), or the measure
-- would miss the calls that left the record but not the vendor's window,
-- and take them for other consumers' (a counter of 40 buckets of a 2 s
-- window, answers 105 ms late: a third of the window's tokens). The
-- meta's lag is the longest lateness of the latest answers, no longer
-- than the policy's longest window, held for LAG_HOLD of those; each quota
-- of a group keeps the group's, since any of them trims a shared rule. An
-- answer that comes while the record was kept for less measures nothing.
local LAG_HOLD = 8

-- note_lag makes meta m's lag hold an answer late by late after its slot,
-- span being the policy's longest window, and reports whether m changed:
-- a longer lag at once, a lag run out anew, a lag at least half of this
-- one's for LAG_HOLD more windows once half of its hold has passed.
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

-- margins sets, for each windowed rule, the margin in force (r.margin), the
-- window it widens (r.window), the span its data must be kept for its own
-- decisions (r.keep: the widest the window can grow, so that no entry it
-- may count is dropped), and that span and lag (see Answers' lag), which
-- its data is kept for (r.kept).
-- spread is the fleet's, held the widest that calls booked earlier hold
-- (see held_spread): the margin in force keeps half of what each gives;
-- warm is true while the calls a warming quota admitted at once are held,
-- which gives a margin of WARM_MARGIN, up to the ceiling (see Warming up).
-- It returns the smallest guarded margin the fleet's spread gives, a token
-- bucket's own margin included, which a call booked now is held to (see
-- late in waiter.go), or 0 when no rule is guarded.
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
      -- A token bucket's margin does not grow, but its calls are held to
      -- it all the same: one that starts late bunches with the calls after
      -- it at the vendor.
      if least == 0 or r.margin < least then
        least = r.margin
      end
    end
  end
  return least
end

-- Losses. A missing meta key means a new quota, or a Redis that lost its
-- data (a restart without persistence, a failover to a replica that lagged,
-- FLUSHALL). A caller that knew an epoch tells them apart; so does a caller
-- that finds an epoch other than the one it knew: another process, new,
-- met the empty Redis first. The vendor still counts the calls Redis
-- forgot, as many as full windows in the worst case, so from the loss on,
-- every rule is blind (see Blind rules): a log or counter counts as full
-- for its window, a token bucket as empty at the loss, refilling from
-- there, a concurrency rule as taken until a lease has run out, since its
-- holders may still be running.

-- loss_pause returns the time until which the windows of rules rs count as
-- full after a loss at time at. A script given only some of the policy's
-- rules (feedback: those an answer is about) passes the policy's longest
-- window too, as span: every rule of the policy still counts what Redis
-- forgot. Only with blind rules switched off does a loss pause the quota.
local function loss_pause(rs, at, span)
  return at + math.max(longest_window(rs), span or 0)
end

-- The functions of blind rules (see Blind rules, below).
local blind = {}

-- blind.lost notes in meta m a loss at time at, found for cause by (one of
-- PAUSED_BY_*): every rule of the quota is blind from then on. With blind
-- rules switched off, the whole quota pauses for its longest window.
function blind.lost(m, at, rs, span, by)
  m.loss, m.lost_by = at, by
  if OFF.blind_rules then
    pause_for(m, loss_pause(rs, at, span), by)
  end
end

-- check_loss finds a loss the caller knew nothing of: m is the meta read
-- (nil when missing), known the epoch the caller knew (0 for none). It
-- returns the meta to use, whether it changed, and whether this call found
-- the loss; span is as for loss_pause.
local function check_loss(m, now, known, rs, span)
  if not m then
    m = new_meta(now)
    if known > 0 and not OFF.epochs then
      blind.lost(m, now, rs, span, PAUSED_BY_LOSS)
      return m, true, true
    end
    return m, true, false
  end
  if known > 0 and known ~= m.epoch and m.loss < m.epoch and not OFF.epochs then
    -- The data was lost before this epoch began; what the fleet admitted
    -- since is in it.
    blind.lost(m, m.epoch, rs, span, PAUSED_BY_LOSS)
    return m, true, true
  end
  return m, false, false
end

-- lose counts the quota's data as lost now, under a new epoch, for cause by
-- (PAUSED_BY_LOSS when nil): every rule is blind from now on, and every
-- process's sleeping calls, booked in the old epoch, book again.
local function lose(m, now, rs, by)
  m.epoch = now
  blind.lost(m, now, rs, nil, by or PAUSED_BY_LOSS)
end

-- check_seq finds a Redis that went back in time: a failover to a replica
-- that missed the latest writes, a restart from an old snapshot. The meta
-- key is there, with its epoch, but its count of scripts run is behind the
-- one the caller saw (seen, in the caller's epoch known). The bookings
-- Redis forgot still run, and the vendor still counts the calls: the data
-- counts as lost, under a new epoch, so that every process's sleeping
-- calls book again. It returns whether it found a loss.
local function check_seq(m, now, known, seen, rs)
  if known <= 0 or known ~= m.epoch or seen <= m.seq or OFF.seq then
    return false
  end
  lose(m, now, rs)
  return true
end

-- back_by returns a time t set by a clock that has since gone back by
-- step, by the new clock: as far from the new now as it was from the old
-- one. The step is measured from the quota's last acquire script, so a
-- quota idle before the step has its times moved back less than the step,
-- and they end no sooner than they should. A time already past stays.
local function back_by(t, step, now)
  if t <= now then
    return t
  end
  return math.max(t - step, now)
end

-- check_clock finds a Redis whose clock went back (NTP stepped it, a
-- failover to a host whose clock is behind): the calls admitted before the
-- step now lie ahead of its clock, as if booked, and once the step passes a
-- window they lie beyond every window of the calls it admits now, which the
-- vendor still counts with them. When the clock is behind the time of the
-- quota's last acquire script by more than CLOCK_BACK, the data counts as
-- lost, under a new epoch, so that every process's sleeping calls, booked
-- by the old clock, book again. A smaller step only lengthens windows. It
-- returns whether it found a loss.
local CLOCK_BACK = 5000
local function check_clock(m, now, rs)
  if m.last_acquire <= now + CLOCK_BACK or OFF.back_steps then
    return false
  end
  m.pause = back_by(m.pause, m.last_acquire - now, now)
  local before = m.pause
  lose(m, now, rs, PAUSED_BY_CLOCK)
  if m.pause > before then
    m.paused_by = PAUSED_BY_CLOCK
  end
  return true
end

-- announce tells every process listening on the quota's channel (named as
-- its meta key) what one script learned (see news.go): the quota's epoch
-- and pause after a loss or a pause, or the pause of one key.
local function announce_quota(m, now)
  redis.call('PUBLISH', KEYS[1], NEWS.quota .. ' ' .. str(m.epoch) .. ' ' .. str(m.pause) .. ' ' .. str(now))
end

-- booked_ahead reports whether some log or counter of rules rs holds units
-- booked after now: calls sleep towards slots that room given back may
-- bring forward. A counter is not read: it says so whenever it counts.
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

-- ROOM_NAMES is how many processes at most the news of room given back in
-- a log names, and ROOM_LOOK how many units past what was given back it
-- looks at to find them: the processes of the calls booked first after
-- now, which take the room in the order they booked. The others' calls
-- stay where they are: each of their processes would run a script to find
-- no room left, hundreds of scripts for one refund in a fleet of hundreds.
local ROOM_NAMES, ROOM_LOOK = 8, 8

-- movers returns the processes (the limiter ids of the entries' members,
-- as member writes them) of the calls booked first after now under the
-- logs of rs that got units back (freed(r) of them), or nil when every
-- process is told: a counter books no one by name, and feedback's room
-- (freed nil) is a window's.
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

-- announce_room tells the fleet that units given back (a refund, a booking
-- given back) left room in windows up to until_, when calls are booked
-- ahead of now: the processes movers names, or every process when it names
-- none, with calls sleeping towards their slots then ask, in one script
-- call each, to move them to the earliest slots that fit (see
-- Limiter.moveEarlier in Go). freed(r) is how many units rule r got back;
-- nil for room that any call may take. Room that no window from now on
-- holds, or that no booking waits for, is told to no one. Room in a shared
-- rule that holds bookings ahead is told to the group (see Groups), whose
-- every quota may have booked them.
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

-- announce_lowered tells the fleet that a limit in force of the quota
-- dropped now (a cap learned, a larger share left to other consumers of
-- the key): each process's calls booked before it, against the limit
-- before, book again when they wake at their slots (see overtaken in Go).
-- A shared rule's drop is told to the group, whose every quota books in
-- it (see Groups).
local function announce_lowered(m, now, shared)
  if m then
    local channel = shared and GROUP or KEYS[1]
    redis.call('PUBLISH', channel, NEWS.lowered .. ' ' .. str(m.epoch) .. ' ' .. str(now) .. ' ' .. str(now))
  end
end

local function announce_key(until_, now)
  redis.call('PUBLISH', KEYS[1], NEWS.key .. ' ' .. KEYS[2] .. ' ' .. str(until_) .. ' ' .. str(now))
end

-- Blind rules. A rule is blind while the vendor may count calls its data
-- does not hold: from a loss of the quota's data (every rule), or from
-- the moment a deploy added it (see check_policy), its since. A blind log
-- or counter counts as full until since plus its window in force; a token
-- bucket counts as empty at since, refilling from there; a concurrency
-- rule counts as taken until since plus a lease. The rules whose data is
-- intact keep deciding. A rule sees again when that time has passed, or
-- when a vendor's count rebuilds its data for one key (see rebuild in
-- feedback.lua), which <rule key>:rb notes: the time of the rebuild,
-- kept until the blindness would have ended.
--
-- Scouts. While a log or counter is blind for one key, one call may go
-- out to learn where the vendor stands (a scout): the first of a process
-- that hears the vendor's counts (acquire.lua's scout argument), or of any
-- process once an answer stated them (the meta's counted: a process
-- deployed with a new rule has heard none yet), under a
-- rule that such counts reach, for a key that holds no unit since since,
-- once the calls admitted before since have all reached the vendor
-- (blind.settled). Its answer rebuilds the rule; a vendor at its cap
-- refuses it, and tells when it resets.

-- blind.id returns the id of rule r, as compile in throttle.go names its
-- key: the key without the quota's base (or the group's, for a shared
-- rule, "shared:" before it), and a per-key rule's without its key's hash.
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

-- blind.settled returns when the calls admitted before rule r's data
-- began have all reached the vendor: since plus the widest margin its
-- window may take (a call starts within half its margin after its slot,
-- and reaches the vendor within the other half). Read after margins.
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

-- blind.read sets, for rule r of meta m, r.since (when its data began, or
-- 0 when it is whole), r.blind_by (why: PAUSED_BY_LOSS, _CLOCK or
-- _POLICY), r.blind_until and r.blind (blind now). A rule rebuilt since
-- its data began, by a vendor's count, is whole.
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

-- blind.begin notes, in meta m, that the rules of rs not in the newest
-- policy's (m.rules) begin now, and drops the notes of rules no longer
-- in the policy or no longer blind.
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

-- check_policy notes that the quota runs under policy id (see
-- policyID in throttle.go), and reports whether the meta changed. A policy
-- the quota has not run under lately comes with a deploy that changed its
-- rules: a rule of a kind or window the newest policy did not have starts
-- on a key of its own, empty, while the vendor still counts the calls the
-- old rules admitted; so that rule alone begins blind (see Blind rules),
-- and the rules whose data is intact keep deciding. A rule a deploy
-- removes keeps its data: a later deploy that brings it back finds it
-- blind. A new quota takes its first policy as it is, and so does a
-- policy the quota ran under lately (a rollback, or the old version of a
-- rolling deploy): each counts only its own rules' calls.
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

-- pause_until returns the time before which the call's scope is paused,
-- given the quota's own pause; key is the scope's pause key, KEYS[2] when
-- not given.
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

-- oldest_bucket returns the oldest bucket of counter r that a window ending
-- at t touches: a window counts every bucket it touches in full, the partly
-- expired one too (see earliest_counter in acquire.lua).
local function oldest_bucket(r, t)
  return bucket_of(t, r.width) - math.ceil(r.window / r.width)
end

-- bucket_free returns the units token bucket r has free at now, its
-- theoretical arrival time being tat: its burst, less what is still to
-- drain.
local function bucket_free(r, tat, now)
  return math.floor((r.limit * r.interval - math.max(0, tat - now)) / r.interval)
end

-- A log's hint, in the key r.key .. ':next', remembers where the last
-- search of the log ended, so that a log booked far ahead is not read again
-- from the start by every call: "t:at:c:w" says that, with window w, no
-- time from t to at fit c more units. Entries only added keep it true for
-- every call costing c or more, asked from t or later, with a window of w or
-- more. Taking entries out can make room again, but only within a window of
-- them: change lowers the hint below that.
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
-- taken out at time slot. Units of a slot already past make room only at
-- times from now on and within a window of it; when the log's entries from
-- now on already forbid every such time to a call of one unit (the
-- limit-th of them lies within the hint's window of now: those entries hold
-- a full window between now and the first of them plus a window), the
-- hint stays, as true as it was.
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
      -- not a history, and taking an earlier call's units out of it would
      -- let a new call land on a later booking. Other refunds are dropped,
      -- which errs on the safe side.
      set_tat(r.key, tat - (from - to) * r.interval, to > 0 and id or '', now)
    end
  end
end

-- give_back takes the units of call id, of cost, booked at time t, out of
-- every rule of rs: a booking given back frees its slot for the next call.
local function give_back(rs, id, cost, t, now)
  for _, r in ipairs(rs) do
    if r.kind == CONCURRENCY then
      zrem(r.key, id, 1, units(r, cost))
    else
      change(r, id, units(r, cost), 0, t, now)
    end
  end
end

-- Learned caps. A vendor may lower its cap without warning, and answer 429
-- past it. When it refuses a call for being over its limit (feedback.lua,
-- told so by the transport or by Permit.Refused), each counting rule the
-- refusal is about learns a cap (see learn_cap): half its limit at first,
-- then what the fleet had admitted in the vendor's window before a refused
-- call, which the vendor did accept. One refusal drops the limit in force
-- by half at most, so that a refusal about something else (a limit of one
-- endpoint, another consumer of the same key) costs little and is soon
-- made good; a token bucket keeps no history, and halves. From then on
-- every script decides against the cap.
--
-- After CAP_HOLD windows without a refusal, while the fleet fills its
-- capped window, the cap rises, by a step that doubles at each window, back
-- to the configured limit: a vendor that raises its cap again is followed.
-- A refusal during the rise ends it: the cap drops to what the vendor
-- accepted, and holds again.
--
-- The cap of rule r is kept in r.key .. ':cap' as "lim:at:from:next:step":
--   lim   the limit in force, below the configured one; for a token bucket,
--         the units of its burst's span, whose rate falls with it;
--   at    when it last dropped;
--   from  the limit in force before that drop: a refusal of a call decided
--         before the drop drops from there again, not from lim, so that the
--         refusals of the calls in flight at a drop do not compound;
--   next  the earliest time it may rise;
--   step  how much it rises then.
-- The same key keeps the others' share of the rule (see Others' share
-- below) after those five; lim is then the configured
-- limit when no cap was learned.
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

-- Others' share. Other consumers of the vendor's key (a cron job, another
-- service) spend its limit too. Each vendor's count that reaches
-- feedback.lua measures them: what the vendor counted in its window, less
-- what the fleet sent in the same window, is what others sent (see
-- note_others there). A measure errs only low: the fleet's calls close to
-- the one counted count as sent, though some reach the vendor after it (in
-- a burst, the first answers measure the others far too low, the last
-- ones right). So the share is the largest measure of the last window and
-- a half (the fleet's bursts come a window and a margin apart, and their
-- last answers later), kept by periods of a quarter window: a count that
-- measures the others too low does not lower it, and one that measures
-- them too high (a call of the fleet that reached the vendor far earlier
-- than the calls before it) makes the fleet leave more room than needed,
-- never less, for a window and a half. Only the last answer of a burst
-- measures the others right: a smoother statistic (the second largest of
-- a period) measured them a unit low, and let their calls meet full
-- windows. The rule's limit in
-- force leaves the others their share (others_reserve): the fleet's
-- bookings stay within what the others leave, so that their calls find
-- room, instead of taking each unit the moment it frees. The share follows
-- the others down when they stop: their units leave the vendor's window,
-- the measures fall with them, and the periods that saw them are dropped
-- a window and a half later.
-- It is kept as ":vlim:i/top,i/top,...": the vendor's limit as it last
-- stated it (0 when unknown), then, for each period i (the time divided
-- by a period's length) of the last window and a half, its largest
-- measure, in thousandths of a unit per window; for OTHERS_TTL windows
-- after the last measure.
local OTHERS_PERIODS = 4
local OTHERS_KEPT = 6
local OTHERS_TTL = 8
local NO_MEASURE = -1000000000

-- others_period returns the period of time t for rule r, a table's key:
-- past OTHERS_KEY_FLOOR, since gopher-lua (miniredis's Lua) fills a table's
-- array part with nils up to a positive integer key below 2^26, and an
-- hourly rule's period of now is about three million: every script that
-- read the others' share of such a rule took a hundred milliseconds there
-- (Lua's own tables keep such keys in their hash part).
local OTHERS_KEY_FLOOR = 2 ^ 27
local function others_period(r, t)
  return OTHERS_KEY_FLOOR + math.floor(t / math.max(math.floor(span_of(r) / OTHERS_PERIODS), 1))
end

-- others_share sets the share o.share in force at time t for rule r, in
-- thousandths of a unit per window, and drops the periods that left the
-- window.
local function others_share(r, o, t)
  local cur, share = others_period(r, t), NO_MEASURE
  for i, p in pairs(o.p) do
    if i < cur - OTHERS_KEPT then
      o.p[i] = nil
    else
      share = math.max(share, p)
    end
  end
  o.share = share
end

-- others_reserve returns the units a rule leaves others of base, the
-- vendor's limit, from their share o: its whole units, and a sixteenth of
-- them and one more, for the jitter of their calls (a window of an even
-- pace holds one call more at times) and for the measures, which err low;
-- that more is at most half the room the share leaves. None for a share
-- under a unit.
local function others_reserve(o, base)
  if not o or o.share < 1000 then
    return 0
  end
  local share = math.floor(o.share / 1000)
  return share + math.min(math.floor(share / 16) + 1, math.max(math.floor((base - share) / 2), 1))
end

-- apply_limits makes the limit in force of rule r its learned cap, or its
-- configured limit, less what the vendor's limit leaves others (r.reserve):
-- the vendor's stated limit, or, when it stated none, that same cap or
-- limit. r.spare is the part of the reserve beyond the others' share.
local function apply_limits(r)
  local lim = r.cap and r.cap.lim or r.conf
  r.reserve, r.spare = 0, 0
  if r.oth and r.kind ~= BUCKET then
    local base = r.oth.vlim > 0 and r.oth.vlim or lim
    r.reserve = others_reserve(r.oth, base)
    r.spare = math.max(r.reserve - math.floor(r.oth.share / 1000), 0)
    lim = math.min(lim, base - r.reserve)
  end
  set_limit(r, lim)
end

-- read_caps applies the learned caps and the others' shares of rules rs,
-- when the meta says some rule of the quota may have one.
local function read_caps(rs, m, now)
  if not m or m.caps_until <= now then
    return
  end
  for _, r in ipairs(rs) do
    if r.kind ~= CONCURRENCY then
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
        local o = { vlim = tonumber(vlim), p = {} }
        for i, top in string.gmatch(periods, '(%-?%d+)/(%-?%d+)') do
          o.p[tonumber(i)] = tonumber(top)
        end
        others_share(r, o, now)
        r.oth = o
      end
      if r.cap or r.oth then
        apply_limits(r)
      end
    end
  end
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
      ps[#ps + 1] = str(i) .. '/' .. str(p)
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

-- learn_cap lowers rule r's cap after the vendor refused a call decided at
-- time as_of, and reports whether the cap dropped. A first refusal halves
-- the limit in force: what the fleet admitted before the refused call says
-- little then, since the vendor may have counted it under a higher cap
-- that it has just lowered. A refusal of a call decided under the cap
-- lowers it to what the fleet admitted in the vendor's window before the
-- call, which the vendor accepted, and by half at most. A refusal of a call
-- decided before the cap's last drop (the calls in flight at a drop) lowers
-- it only to that count, never below half the limit before the drop.
--
-- A vendor that states its limit with the refusal (x-ratelimit-limit and
-- the like: vlimit > 0) is taken at its word, within the same bound of
-- half.
local function learn_cap(r, as_of, m, now, vlimit)
  if OFF.learned_caps then
    return false
  end
  local c = r.cap
  local lim, from
  if not c then
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

-- raise_caps raises, by their steps, the caps of rules rs whose hold has
-- ended and whose capped window the fleet fills (r.n, read by load): a cap
-- the fleet does not reach learns nothing from rising. It reports whether
-- a cap changed.
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

-- Classes' bookings given back. A call of a class (see Classes in
-- acquire.lua) counts under each log or counter rule that serves classes
-- in its class's demand (the ':cl' hash) and, where the rule held a share
-- against it, in its class's own log; acquire.lua answers, for each call,
-- where (classes_of). A booking given back (cancel.lua, a call that books
-- again or moves in acquire.lua) or settled at another cost (settle.lua)
-- changes those counts too: left there, a call that books again would
-- count twice in its class, which would then hold less room, and lose it.
local CLASS_PERIODS = 4

-- NONE is the cost of a booking given back.
local NONE = { all = 0, total = 0 }

-- A class's field of ':cl' lists its periods, each
-- "period:units:waited[/ahead]": CLASS_PART reads one, class_part writes
-- one (ahead left out when 0).
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

-- change_period changes by d the units that class name booked in the
-- period of time t under rule r, in its ':cl' field, never below 0, and
-- those of them booked ahead too for a booking that was (ahead).
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

-- change_classes applies to the classes of call id, booked at t, the
-- change of its cost from cost `from` to `to` (read_cost; to is NONE for a
-- booking given back): in its classes' own logs, and, unless logs_only,
-- in their demand; part 'logs' or 'demand' changes that part alone.
-- where is the booking (ARGS.booking) as acquire.lua answered for the
-- call (classes_of there): its class and priority and, by the rules'
-- places, where it counted (noted 0 for a call of no class), and whether
-- it was booked ahead of its script's time.
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
