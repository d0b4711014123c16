-- acquire.lua: admit, book or refuse a batch of calls against every rule of
-- a quota, atomically, in the order given. Calls that run at the same moment in
-- one process share one script call; each is decided as if alone, after the
-- ones before it. A call is recorded only when it is admitted or booked; a
-- refused call writes nothing but its class's demand (see Classes).
--
-- KEYS and ARGV as in lib.lua; after the rules, ARGS.acquire (the caller,
-- what it last saw of the quota, its timing and policy, and how many of
-- each group follow: see internal/protocol), then:
--   for each lateness bucket its calls fell in since its last report,
--   ARGS.late (see note_timing in lib.lua);
--   for each scope (key of the quota) but the first, the one of KEYS, its
--   pause key and then one key per rule, in the order of the rules (a
--   shared rule's key is the one in KEYS);
--   for each booking to give back (a call that would start too late books
--   again in the same script call), ARGS.give: the booking as its answer
--   gave it, and its scope (1..s);
--   for each call, ARGS.call: its id, unique across the fleet; its cost;
--   the longest wait in microseconds it accepts (0 admits only now); the
--   least, in microseconds (a call whose last slot came back from Redis
--   too late to start in asks for one that far ahead, so that the reply
--   arrives before it); its scope (1..s); for a call that moves its
--   booking earlier, the booking's place among those given back (1..g),
--   else 0: when nothing earlier fits, the call keeps its slot (see
--   decide); and its class's name and priority (see Classes), the name
--   "" for a call of no class (ArrivalOrder).
--
-- Returns REPLY.acquire {now, pause, epoch, lost, margin, done, seq, paused,
-- paused_by}, then for each call REPLY.answer {admitted, wait, remaining,
-- reason, blind_by, pause, noted, logged, room}:
--   now        the time the script used, in microseconds;
--   pause      the time until which the quota or the first scope's key is
--              paused, or 0; after each call, the same for the call's scope;
--   epoch      the quota's epoch;
--   lost       1 when this call found that Redis lost the quota's data;
--   margin     the smallest margin in force of the guarded windows, in
--              microseconds, or 0 when no window is guarded (see margins);
--   done       the time the script ended (now, for a script that did little:
--              see LONG_WORK): a call admitted now starts no earlier, and the
--              caller measures the reply's trip from it;
--   seq        the quota's count of scripts run, this one included;
--   paused     the time until which the quota itself is paused, or 0;
--   paused_by  why (PAUSED_BY_* in lib.lua), or 0: a call's pause that ends
--              later is its key's, which only the vendor sets;
--   admitted   1 when the call was admitted (wait 0) or booked (wait > 0), else 0;
--   wait       microseconds from now until the call's slot; when refused, how long
--              until it would fit (its retry-after);
--   remaining  units still free now under the tightest rule, after the call,
--              its class's own log included (see Classes);
--   reason     REASON.admitted (0) admitted; REASON.too_far (1) refused: the slot
--              lies beyond the wait accepted; REASON.busy (2) refused: a
--              concurrency rule is full (no slot can be booked, since no one
--              knows when a holder will finish; wait is then the time until the
--              first lease runs out); REASON.share (3) refused: the call is
--              larger than the quota's share reserved after a Local outage
--              (wait: until the reserve ends);
--   blind_by   when a blind rule refused it, why (PAUSED_BY_*), else 0
--              (see Blind rules in lib.lua);
--   noted      for a call admitted or booked, the rules whose class demand
--              counts it, rule i as the bit 2^(i-1) (see Classes); else 0;
--   logged     the same for the rules whose class's own log holds it;
--   room       as remaining, under the rules alone: a class's own log, which
--              narrows what its calls take, is no count a vendor keeps.

local now = clock()

-- A script that reads, writes or drops more than LONG_WORK entries of a
-- log, reads a log by rank, or decides more than LONG_CALLS calls, reads the clock
-- again when it ends (done, in its reply); one that did less ends within a
-- fraction of a millisecond of now, which it answers for done instead,
-- sparing a command: the least margin a call is guarded by allows it 2.5 ms.
local LONG_WORK = 256
local LONG_CALLS = 16

-- A log drops the entries that have left every window in about one script
-- in TRIM_EVERY, by the microsecond the script runs at (not by the quota's
-- count of scripts, which a key touched every other script would never
-- meet): the searches count and read only the entries after a window's
-- start, so older ones cost only the memory of a few scripts' calls, and
-- the trim a command in most scripts.
local TRIM_EVERY = 8

-- load drops what has left every window and reads the state each rule
-- decides from.
local function load(r)
  if r.kind == LOG then
    -- Entries are kept as long as the widest margin could count them, and
    -- the answers' lag (r.kept); the window in force counts those after
    -- now - r.window.
    if now % TRIM_EVERY == 0 or OFF.lazy_trim then
      r.long = redis.call('ZREMRANGEBYSCORE', r.key, '-inf', str(now - r.kept)) > LONG_WORK
    end
    r.n = redis.call('ZCOUNT', r.key, '(' .. str(now - r.window), '+inf')
    if r.blind then
      -- No scout yet: no unit since the rule's data began.
      r.scout_free = redis.call('ZCOUNT', r.key, str(r.since), '+inf') == 0
    end
  elseif r.kind == COUNTER then
    -- The oldest bucket a window ending now may touch, as earliest_counter
    -- counts them; older ones are dropped once no margin could count them
    -- and no answer measure them (r.kept).
    local oldest = oldest_bucket(r, now)
    local kept = bucket_of(now, r.width) - math.ceil(r.kept / r.width)
    local raw = redis.call('HGETALL', r.key)
    r.counts, r.bs, r.n, r.scout_free = {}, {}, 0, r.blind
    for k = 1, #raw, 2 do
      local b, n = tonumber(raw[k]), tonumber(raw[k + 1])
      if b < kept or n <= 0 then
        redis.call('HDEL', r.key, raw[k])
      else
        r.counts[b] = n
        r.bs[#r.bs + 1] = b
        if b >= oldest then
          r.n = r.n + n
        end
        if (b + 1) * r.width > r.since then
          r.scout_free = false
        end
      end
    end
    table.sort(r.bs)
  elseif r.kind == BUCKET then
    r.tat = tat_of(r.key)
    if r.since > 0 then
      r.tat = math.max(r.tat, r.since + r.limit * r.interval)
    end
  elseif r.kind == CONCURRENCY then
    redis.call('ZREMRANGEBYSCORE', r.key, '-inf', str(now))
    r.n = redis.call('ZCARD', r.key)
    if now < r.since + r.lease then
      r.n, r.lost_until = r.limit, r.since + r.lease
    end
  else
    error('unknown rule kind ' .. tostring(r.kind))
  end
  r.tmax = now
end

-- free is the units the rule has free now, bookings ahead counted: none
-- in a blind log or counter (see Blind rules in lib.lua).
local function free(r)
  if r.kind == BUCKET then
    return bucket_free(r, r.tat, now)
  elseif r.blind and r.kind ~= CONCURRENCY then
    return 0
  end
  return r.limit - r.n
end

-- blind.floor returns the earliest time a blind log or counter r admits a
-- call at: once the calls before its data began have reached the vendor,
-- for a scout (see Scouts in lib.lua), else the end of its blindness.
function blind.floor(r)
  if r.scout and r.about and r.scout_free then
    return blind.settled(r)
  end
  return r.blind_until
end

-- A log's entries after the first time a search needs, read once per
-- script into memory (r.seg: the scores after lo, ascending, with the
-- entries the script records since, which record adds) unless there are
-- more than SEGMENT of them: each call of a batch then searches among them
-- without asking Redis again, where reading them by rank costs a count and
-- two reads each.
local SEGMENT = 1024

-- first_after returns the index of the first of the ascending scores s
-- that is greater than x, or #s + 1.
local function first_after(s, x)
  local lo, hi = 1, #s + 1
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if s[mid] > x then
      hi = mid
    else
      lo = mid + 1
    end
  end
  return lo
end

-- seg_insert inserts n entries at score into the ascending scores s.
local function seg_insert(s, score, n)
  local at = first_after(s, score)
  for _ = 1, n do
    table.insert(s, at, score)
  end
end

-- record writes the call into the state the next call of the batch decides
-- from.
local function record(r, t, id, cost)
  r.tmax = math.max(r.tmax, t)
  r.recorded = true
  r.fits = nil
  r.scout_free = false
  if r.kind == LOG or r.kind == CONCURRENCY then
    local score = t
    if r.kind == CONCURRENCY then
      -- A concurrency slot is held from now, even for a booked call, until
      -- the call releases it or its lease runs out.
      score = t + r.lease
    end
    if score ~= r.at then
      -- The calls of a batch admitted now share one time, formatted once.
      r.at, r.at_str = score, str(score)
    end
    local p = r.pending or {}
    r.pending = p
    local n = #p
    for u = 1, cost do
      p[n + 1], p[n + 2] = r.at_str, member(id, u)
      n = n + 2
    end
    r.n = r.n + cost
    if r.seg and score > r.seg.lo then
      seg_insert(r.seg.s, score, cost)
    end
  elseif r.kind == COUNTER then
    local b = bucket_of(t, r.width)
    if not r.counts[b] then
      -- A bucket newly in use takes its place among the others.
      local i = #r.bs + 1
      while i > 1 and r.bs[i - 1] > b do
        i = i - 1
      end
      table.insert(r.bs, i, b)
    end
    r.counts[b] = (r.counts[b] or 0) + cost
    r.added = r.added or {}
    r.added[b] = (r.added[b] or 0) + cost
    r.n = r.n + cost
  else
    r.tat = math.max(r.tat, t) + cost * r.interval
    r.last_id = id
  end
end

-- flush writes what the batch recorded in rule r to Redis, in as few
-- commands as it can.
local function flush(r)
  if r.pending then
    for i = 1, #r.pending, 1000 do
      redis.call('ZADD', r.key, unpack(r.pending, i, math.min(i + 999, #r.pending)))
    end
    r.pending = nil
  elseif r.added then
    for b, n in pairs(r.added) do
      redis.call('HINCRBY', r.key, str(b), n)
    end
    r.added = nil
  elseif r.last_id then
    set_tat(r.key, r.tat, r.last_id, now)
    r.last_id = nil
  end
end

-- How much of a log one call may read, in entries, before it settles for
-- the time after the log's last entries. A log is read by rank, a few
-- entries at a time where the search needs them, so that a call reads
-- about as many entries as its search steps over, not the whole log.
local SCAN = OFF.read_budget and math.huge or 512
local FIRST_READ = 4
local MAX_READ = 256

-- scores returns the scores of the entries of ranks from .. from+n-1 (from
-- 0), fewer at the end of the log.
local function scores(key, from, n)
  local raw = redis.call('ZRANGE', key, from, from + n - 1, 'WITHSCORES')
  local out = {}
  for k = 2, #raw, 2 do
    out[#out + 1] = tonumber(raw[k])
  end
  return out
end

-- log_tail returns the earliest time >= t after every entry of the log at
-- which the new units fit: past the last entry, and a window after the
-- entry that has room units after it. Two lookups by rank find it, however
-- long the log.
local function log_tail(r, t, room)
  flush(r)
  local total = redis.call('ZCARD', r.key)
  local last = redis.call('ZRANGE', r.key, -1, -1, 'WITHSCORES')
  local nth = redis.call('ZRANGE', r.key, total - 1 - room, total - 1 - room, 'WITHSCORES')
  return math.max(t, tonumber(last[2]), tonumber(nth[2]) + r.window)
end

-- segment returns log r's segment holding every entry after lo, reading
-- it if need be; nil for a log with more than SEGMENT entries after the
-- first lo a search of this script needed (booked far ahead), which is
-- read by rank (earliest_log).
local function segment(r, lo)
  local seg = r.seg
  if seg == false or seg and seg.lo <= lo then
    return seg or nil
  end
  flush(r)
  local raw = redis.call('ZRANGEBYSCORE', r.key, '(' .. str(lo), '+inf', 'WITHSCORES', 'LIMIT', 0, SEGMENT + 1)
  if #raw > 2 * SEGMENT then
    r.seg = false
    return nil
  end
  local s = {}
  for k = 2, #raw, 2 do
    s[#s + 1] = tonumber(raw[k])
  end
  r.long = r.long or #s > LONG_WORK
  r.seg = { lo = lo, s = s }
  return r.seg
end

-- earliest_in_segment is earliest_log among the ascending scores s, which
-- hold every entry after t - w: the same pass, in memory.
local function earliest_in_segment(r, s, t, room, budget)
  local w = r.window
  local j = first_after(s, t - w)
  while true do
    local a, b = s[j], s[j + room]
    if b == nil or b - w >= t then
      return t
    end
    if budget.left <= 0 then
      return log_tail(r, t, room)
    end
    if b - a < w and t < a + w then
      t = a + w
    end
    j = j + 1
    budget.left = budget.left - 1
  end
end

-- earliest_log returns the earliest time >= t at which cost more units fit
-- in every window of the log that would hold them: a window of length
-- w = r.window may already hold room = limit - cost units.
--
-- Any room+1 consecutive entries s[j] .. s[j+room] that lie within w of each
-- other forbid exactly the times in the open interval (s[j+room] - w,
-- s[j] + w): a call there would share one window with all of them. Those
-- intervals start and end in ascending order, so one pass from the first
-- entry after t - w finds the first allowed time. Bookings ahead count like
-- any other entry, so a freed booking can never let a window overfill, and
-- a gap between bookings is used when it is wide enough. A pass longer than
-- the budget (a log booked far ahead) settles for the time after the whole
-- log, which is always allowed.
local function earliest_log(r, t, cost, budget)
  local room, w = r.limit - cost, r.window
  r.long = true
  flush(r)
  -- j, the rank of the first entry after t - w; a and b hold the scores of
  -- the entries from rank j and from rank j + room, read as needed.
  local j = redis.call('ZCOUNT', r.key, '-inf', str(t - w))
  local a, b, i, n = {}, {}, 1, FIRST_READ
  while true do
    if i > #a then
      if budget.left <= 0 then
        return log_tail(r, t, room)
      end
      a, b, i = scores(r.key, j, n), scores(r.key, j + room, n), 1
      budget.left = budget.left - 2 * n
      n = math.min(2 * n, MAX_READ)
      if #b == 0 then
        return t
      end
    end
    if i > #b then
      -- Fewer than room+1 entries from here on: no window can fill.
      return t
    end
    if b[i] - w >= t then
      return t
    end
    if b[i] - a[i] < w and t < a[i] + w then
      t = a[i] + w
    end
    if a[i + 1] == a[i] and a[#a] == a[i] then
      -- The entries after it at the same time (the units of one call),
      -- to the end of what was read and beyond, forbid no time it does
      -- not, or none before t: on to the first entry after them, by its
      -- rank, rather than read them.
      j = redis.call('ZCOUNT', r.key, '-inf', str(a[i]))
      i, n = #a + 1, FIRST_READ
      budget.left = budget.left - 1
    else
      i, j = i + 1, j + 1
    end
    budget.left = budget.left - 1
  end
end

-- earliest_counter returns the earliest time >= t at which cost more units fit
-- a sliding counter. A window of length w that ends in bucket j may touch
-- buckets j-m .. j; each is counted in full, the partly expired one too, so no
-- window ever holds more than the limit. The units at t fall in bucket k and
-- into the windows ending in buckets k .. k+m, which must all have room.
--
-- Put another way, the m+1 buckets from i on hold W(i) units, and a window
-- too full to take the call (W(i) > limit - cost) forbids buckets i .. i+m.
-- W changes only where a bucket that holds units enters (at i = b - m) or
-- leaves (at i = b + 1), so one sweep over the buckets that hold units,
-- r.bs in ascending order, finds the first bucket no full window forbids:
-- the work follows the buckets in use, not the span they cover.
local function earliest_counter(r, t, cost)
  local width, room = r.width, r.limit - cost
  if r.n <= room then
    return t
  end
  local m = math.ceil(r.window / width)
  local k0 = bucket_of(t, width)
  local k = k0
  local bs, counts = r.bs, r.counts
  local n = #bs
  local enter, leave, w = 1, 1, 0
  while leave <= n do
    -- The next place W changes; past k, no window can forbid k any more.
    local at = bs[leave] + 1
    if enter <= n then
      at = math.min(at, bs[enter] - m)
    end
    if at > k then
      break
    end
    while enter <= n and bs[enter] - m == at do
      w = w + counts[bs[enter]]
      enter = enter + 1
    end
    while leave <= n and bs[leave] + 1 == at do
      w = w - counts[bs[leave]]
      leave = leave + 1
    end
    if w > room then
      -- W stays this high until its next change: the windows from at to
      -- there forbid buckets at .. (next - 1) + m.
      local nxt = bs[leave] + 1
      if enter <= n then
        nxt = math.min(nxt, bs[enter] - m)
      end
      if nxt - 1 + m >= k then
        k = nxt + m
      end
    end
  end
  if k == k0 then
    return t
  end
  return k * width
end

-- paced returns the earliest time >= t at least r.pace away from every
-- entry of log r (see Pacing in lib.lua), reading the entries from t - r.pace
-- on, PACE_READ at most. A log whose entries lie closer together than that
-- read covers settles for r.pace after its last entry. The time is one the
-- rules must settle from again.
local PACE_READ = 16
local PACED_SCAN = 32
local function paced(r, t)
  flush(r)
  local raw = redis.call('ZRANGEBYSCORE', r.key, '(' .. str(t - r.pace), '+inf', 'WITHSCORES', 'LIMIT', 0, PACE_READ)
  for k = 2, #raw, 2 do
    local e = tonumber(raw[k])
    if e >= t + r.pace then
      return t
    end
    t = math.max(t, e + r.pace)
  end
  if #raw < 2 * PACE_READ then
    return t
  end
  local last = redis.call('ZRANGE', r.key, -1, -1, 'WITHSCORES')
  return math.max(t, tonumber(last[2]) + r.pace)
end

-- search_from returns the time from which a search by rank of log r for
-- cost units, asked from t, begins, and the log's hint as it was before
-- the search: so the calls of a batch, and the calls of later batches
-- through the log's hint, do not each read a log booked far ahead again
-- (see read_hint in lib.lua).
local function search_from(r, t, cost)
  local from = t
  if r.hint == nil then
    r.hint = read_hint(r)
  end
  local h = r.hint
  if h and h.c <= cost and h.t <= t and h.w <= r.window and h.at > from then
    -- The search begins at the hint.
    from = h.at
  end
  return from, h
end

-- keep_hint makes the hint of log r say what a search for cost units,
-- asked from t, found: no room before at; h is the hint the search began
-- with.
--
-- A search that began at the hint, or from within the times it holds
-- for, found no room from the hint's at to its own either: the new hint
-- holds from the old one's t, so that a call asked from later (one that
-- books ahead of its late reply) does not make the calls asked from now
-- read the log again. A search from beyond the hint's at (from a paced
-- time past room the hint stops at) leaves the hint as it was, unless
-- that room is already past.
local function keep_hint(r, h, t, cost, at)
  local joins = h and h.c <= cost and h.w <= r.window and h.t <= t and h.at >= t
  if not h or cost < h.c or h.t > t or h.w > r.window or cost == h.c and at > h.at and (joins or h.at < now) then
    local since = t
    if joins then
      since = h.t
    end
    r.hint = { t = since, at = at, c = cost, w = r.window }
    r.hint_changed = true
  end
end

-- earliest_in_log returns the earliest time >= t at which log r takes cost
-- more units, searching its entries only where the searches before this
-- one have not.
local function earliest_in_log(r, t, cost, budget)
  -- Only a log too full to take the call outright needs its entries read.
  if r.n <= r.limit - cost then
    return t
  end
  -- The time a search of this script found for cost units fits them
  -- until a call is recorded: the rounds over the rules of a policy ask
  -- again there, and need not read the log again.
  if r.fits and r.fits.c == cost and r.fits.at == t and not OFF.fits then
    return t
  end
  if r.n <= SEGMENT and not OFF.segment then
    -- Short enough to be read whole from a window before the search's
    -- start: searched in memory, with no hint to read or write.
    local seg = segment(r, t - r.window)
    if seg then
      local at = earliest_in_segment(r, seg.s, t, r.limit - cost, budget)
      r.fits = { c = cost, at = at }
      return at
    end
  end
  local from, h = search_from(r, t, cost)
  -- A search that settled for the log's tail leaves the hint there too:
  -- room deeper in the log than one search reads stays unused, as it
  -- would for every later call anyway, until entries taken out of the
  -- log lower the hint.
  local at = earliest_log(r, from, cost, budget)
  r.fits = { c = cost, at = at }
  keep_hint(r, h, t, cost, at)
  return at
end

-- earliest returns the earliest time >= t at which rule r takes cost more
-- units; NEVER for a full concurrency rule, since no one knows when a
-- holder will finish.
local function earliest(r, t, cost, budget)
  if r.blind and (r.kind == LOG or r.kind == COUNTER) then
    t = math.max(t, blind.floor(r))
  end
  if r.kind == LOG then
    return earliest_in_log(r, t, cost, budget)
  elseif r.kind == COUNTER then
    return earliest_counter(r, t, cost)
  elseif r.kind == BUCKET then
    -- GCRA: the call conforms once its units fit under the burst above the
    -- theoretical arrival time.
    return math.max(t, r.tat - (r.limit - cost) * r.interval)
  elseif r.n + cost <= r.limit then
    return t
  end
  return NEVER
end

-- The steps of the script. They share one table, batch: the arguments of
-- the batch of calls, and what each step learns for the ones after it.

-- read_scopes reads the scopes from ARGV[arg] on, into batch.scopes and
-- batch.objs, and returns the place after them.
--
-- The calls of one script call may be for several keys of the quota: the
-- first key's rules are in KEYS; each other key comes as its pause key and
-- then one key per rule, a shared rule's key as in KEYS. A rule whose key
-- is the first scope's is the same rule for both: one object, read,
-- decided and written once. objs holds each rule object once.
local function read_scopes(batch, arg)
  local rs = batch.rs
  batch.scopes = { { rs = rs, pause_key = KEYS[2] } }
  batch.objs = {}
  for i, r in ipairs(rs) do
    batch.objs[i] = r
  end
  for s = 2, batch.nscopes do
    local srs = {}
    local pause_key = ARGV[arg]
    arg = arg + 1
    for i, r in ipairs(rs) do
      local key = ARGV[arg]
      arg = arg + 1
      if key == r.key then
        srs[i] = r
      else
        local c = {}
        for k, v in pairs(r) do
          c[k] = v
        end
        c.key = key
        srs[i] = c
        batch.objs[#batch.objs + 1] = c
      end
    end
    batch.scopes[s] = { rs = srs, pause_key = pause_key }
  end
  return arg
end

-- call_args returns call c (from 0) of the batch, as ARGS.call read it,
-- once only: with its cost read, its scope, its rules, the booking it
-- moves (one given back in this script, or nil), and the fields read_call
-- fills.
local function call_args(batch, c)
  local call = batch.call_args[c + 1]
  local sc = batch.scopes[call.scope]
  call.cost, call.scope, call.rs, call.pause = read_cost(call.cost), sc, sc.rs, sc.pause
  call.remaining, call.after, call.too_big, call.room, call.room_after = NEVER, NEVER, false, NEVER, NEVER
  call.moves = batch.given[call.moves]
  return call
end

-- read_args reads the rules and the arguments of the script's own (see
-- the header), in their order, and returns the table the steps share.
local function read_args()
  local at = after_rules()
  local batch
  batch, at = ARGS.acquire(at)
  batch.rs = rules()
  if OFF.rebuild then
    batch.scout = 0
  end
  if batch.limiter == '' then
    batch.limiter = nil
  end
  if batch.lates > 0 then
    batch.report = {}
    for k = 1, batch.lates do
      batch.report[k], at = ARGS.late(at)
    end
  end
  batch.nscopes, batch.ncalls, batch.ngive = batch.scopes, batch.calls, batch.gives
  at = read_scopes(batch, at)
  -- The bookings to give back, each with its cost read and its scope.
  batch.give_args = batch.ngive > 0 and {} or nil
  for g = 1, batch.ngive do
    local b
    b, at = ARGS.give(at)
    b.cost, b.scope = read_cost(b.cost), batch.scopes[b.scope]
    batch.give_args[g] = b
  end
  batch.call_args = {}
  for c = 1, batch.ncalls do
    batch.call_args[c], at = ARGS.call(at)
  end
  batch.at_once = false -- some call was admitted now
  batch.units = 0 -- the units the calls admitted and booked cost
  batch.given = {} -- the bookings given back, by their place from 1
  return batch
end

-- read_fleet reads the quota's meta, nil when missing, and folds into it
-- what the calling process reports of its calls' timing; from the fleet's
-- spread it sets the margins in force of every rule (see margins in
-- lib.lua), and whether the quota warms up.
local function read_fleet(batch)
  local meta = read_meta(true)
  if meta and now - meta.refreshed > META_REFRESH then
    meta.refreshed = now
  end
  batch.span = longest_window(batch.rs)
  batch.start = starting(meta, now, batch.span) and not OFF.warm_up
  batch.warming = batch.start or meta ~= nil and meta.warm_until > now
  if meta then
    note_timing(meta, now, batch.report, batch.delay)
    roll_hold(meta, now)
  end
  batch.spread = fleet_spread(meta, now)
  batch.margin = margins(batch.objs, batch.spread, held_spread(meta, now), meta and meta.warm_held > now, lag_of(meta, now))
  return meta
end

-- describe keeps in meta m the policy a limiter described, text, with its
-- age in microseconds: the newest limiter's,
-- made last by the script's clock (now less its age), whatever order the
-- fleet describes in. An old version's limiter may describe last: its
-- first call came late, or a loss made every limiter describe again.
local function describe(m, age, text)
  if text ~= '' and now - age >= m.policy_made then
    m.policy, m.policy_made = text, now - age
  end
end

-- Each limiter's own count. The quota's count of scripts run (seq) finds
-- a Redis gone back in time only if the caller saw a count that Redis
-- lost, and the other processes' scripts make it up again. So the quota
-- also counts each limiter's own acquire scripts of the epoch, in the
-- hash <meta key without meta>ran, by the limiter's id: a limiter never
-- has more scripts answered than Redis counts for it, unless Redis lost
-- them (see check_seq in lib.lua). The hash starts again with each
-- epoch, and lives as long as the meta key.

-- check_meta finds whether Redis lost the quota's data (see Losses in
-- lib.lua): a missing or changed meta key may mean that it did (see
-- check_loss), and so do a count of scripts run behind the caller's, a
-- clock gone back, and a clock the caller saw step forward. It counts this
-- script among those run: batch.meta is then the meta to write back, and
-- batch.found true when this script found a loss.
local function check_meta(batch, meta)
  -- count_own counts this script in the caller's own count, and reports
  -- whether the quota's data is lost: found already, or a count behind the
  -- scripts the caller had answered in this epoch (batch.ran, counted in
  -- epoch batch.ran_in). epoch is the one the meta had when read.
  local function count_own(batch, meta, epoch, found)
    if not batch.limiter or OFF.own_seq then
      return found
    end
    local key = string.sub(KEYS[1], 1, -5) .. 'ran'
    if meta.epoch ~= epoch then
      -- A new epoch, a new count.
      redis.call('DEL', key)
    end
    local n = redis.call('HINCRBY', key, batch.limiter, 1)
    if not found and batch.ran_in == meta.epoch and n <= batch.ran then
      lose(meta, now, batch.rs)
      redis.call('DEL', key)
      n, found = redis.call('HINCRBY', key, batch.limiter, 1), true
    end
    if n == 1 or meta.refreshed == now then
      redis.call('PEXPIRE', key, math.max(META_TTL, 2 * longest_window(batch.rs) / 1000))
    end
    return found
  end
  local created = meta == nil
  local epoch = meta and meta.epoch
  batch.pause_before = meta and meta.pause or 0
  local _, found
  meta, _, found = check_loss(meta, now, batch.known, batch.rs)
  if not found and check_seq(meta, now, batch.known, batch.seen, batch.rs) then
    found = true
  end
  local step = meta.last_acquire - now
  if not found and not created and check_clock(meta, now, batch.rs) then
    found, batch.back = true, step
    -- The description's time is by the clock that went back; all describe again.
    meta.policy_made = 0
  end
  meta.seq = meta.seq + 1
  check_policy(meta, now, batch.policy, batch.rs, created)
  if meta.began ~= '' and string.find(meta.policies, batch.policy, 1, true) == 1 then
    -- The newest policy's calls drop the rules no longer blind.
    blind.begin(meta, now, batch.rs)
  end
  describe(meta, batch.age, batch.described)
  if not found and meta.loss < batch.stepped then
    -- A forward step shortened the windows: a clock's loss, not Redis's,
    -- whose data is whole: the bookings of the epoch it ends are still
    -- given back (give_back_bookings).
    batch.whole_epoch = meta.epoch
    lose(meta, now, batch.rs, PAUSED_BY_CLOCK)
    found = true
  end
  if batch.start then
    meta.warm_until = now + batch.span
  end
  meta.last_acquire = now
  batch.meta, batch.found = meta, count_own(batch, meta, epoch, found)
end

-- reserve lowers every limit to its reserved share while the quota is
-- reserved. Replicas of the Local fallback may still be deciding without
-- Redis, each within 1/n of each limit: until they are all back, Redis
-- keeps to the share none of them takes.
local function reserve(batch)
  local meta = batch.meta
  batch.reserved = meta.reserved_until > now and meta.reserved_share > 1 and not OFF.reserve
  if not batch.reserved then
    return
  end
  for _, r in ipairs(batch.objs) do
    r.whole = { limit = r.limit, interval = r.interval }
    r.limit = math.max(math.floor(r.limit / meta.reserved_share), 1)
    if r.kind == BUCKET then
      -- A share of the rate and of the burst: a longer interval alone
      -- would lengthen the burst's span with it.
      r.interval = r.interval * meta.reserved_share
    end
  end
end

-- give_back_bookings takes the bookings given back out of their rules,
-- before anything is decided: their slots go to the calls of this batch as
-- to any other. A booking of another epoch is gone with the data it was
-- written in, but one of the epoch that a forward step of the clock ended
-- in this script: that data is whole, and the booking's call asks again.
local function give_back_bookings(batch)
  for g = 0, batch.ngive - 1 do
    local b = batch.give_args[g + 1]
    if b.epoch == batch.meta.epoch or b.epoch == batch.whole_epoch then
      give_back(b.scope.rs, b.id, b.cost, b.slot, now)
      -- Its class's demand still counts it while the calls are decided:
      -- the call that gave it back books again (see leave_classes).
      change_classes(b.scope.rs, b.id, b.cost, NONE, b.slot, b, now, 'logs')
      batch.given[g + 1] = b
    end
  end
end

-- drop_ahead forgets, in the script that finds Redis's clock gone back,
-- what rule r holds ahead of the clock: the calls the old clock admitted
-- and booked, which now lie as far ahead as the clock went back. The data
-- counts as lost (the quota pauses for its windows, a bucket refills from
-- empty, a concurrency rule counts as taken for a lease, and the calls
-- booked in the old epoch book again), so those entries would only hold
-- the rule full for as long as the step: an hour back, an hour refused.
-- A key of the quota that this script does not touch (another key of a
-- PerKey rule) keeps them, and its calls wait out the step.
local function drop_ahead(r)
  if r.kind == LOG or r.kind == CONCURRENCY then
    redis.call('ZREMRANGEBYSCORE', r.key, '(' .. str(now), '+inf')
  end
  if r.kind == LOG then
    -- Only a log keeps a hint, and its caller declares no other rule's.
    redis.call('DEL', r.key .. ':next')
  elseif r.kind == COUNTER then
    local current = bucket_of(now, r.width)
    for _, b in ipairs(redis.call('HKEYS', r.key)) do
      if tonumber(b) > current then
        redis.call('HDEL', r.key, b)
      end
    end
  elseif r.kind == BUCKET then
    redis.call('DEL', r.key)
  end
end

-- back_key_pause moves the pause of one key of the quota, set by a clock
-- that has since gone back by step, to the new clock (see back_by in
-- lib.lua); the quota's own pause is in its meta.
local function back_key_pause(key, step)
  if key == KEYS[1] then
    return
  end
  local v = tonumber(redis.call('GET', key) or '0')
  if v > now then
    redis.call('SET', key, str(back_by(v, step, now)), 'KEEPTTL')
  end
end

-- load_rules reads the state every rule decides from, raises the learned
-- caps the fleet fills, and reads each scope's pause.
local function load_rules(batch)
  local shared = false
  for _, r in ipairs(batch.rs) do
    shared = shared or not r.per_key
  end
  for _, r in ipairs(batch.objs) do
    blind.read(r, batch.meta, now)
    -- A scout goes out only where the vendor's counts reach (rulesAbout in Go).
    r.scout = batch.scout == 1 or batch.scout == 2 and batch.meta.counted > 0
    r.about = r.kind ~= CONCURRENCY and (not r.per_key or not shared)
    if batch.back then
      drop_ahead(r)
    end
    load(r)
  end
  if batch.back then
    for _, sc in ipairs(batch.scopes) do
      back_key_pause(sc.pause_key, batch.back)
    end
  end
  raise_caps(batch.objs, batch.meta, now)
  for _, sc in ipairs(batch.scopes) do
    sc.pause = pause_until(batch.meta.pause, sc.pause_key)
  end
end

-- A quota warming up knows nothing yet of how many calls its fleet can
-- start at once. Many small replicas that start together each ask for one
-- call at a time, and cannot start a burst of them when it is due: Redis
-- answers a burst of scripts at the end of its turn, a few cores run the
-- replies one after the other. So while the quota warms up, a script that
-- decides one call paces it (see Pacing in lib.lua) when the log's latest
-- WARM_PACERS entries are the lone calls of as many other limiters, the
-- latest less than the pace before it: the calls of a burst of small
-- replicas spread over the window instead of starting late. A few
-- replicas, a lone limiter's calls, and a process's batch, which it starts
-- together, are admitted at once.
local WARM_PACERS = 8

-- crowded reports whether the latest WARM_PACERS entries of log r are the
-- calls of as many limiters other than own, the latest less than pace
-- before now.
local function crowded(r, own, pace)
  local last = redis.call('ZRANGE', r.key, -WARM_PACERS, -1, 'WITHSCORES')
  if #last == 2 * WARM_PACERS and tonumber(last[#last]) > now - pace then
    local others, n = {}, 0
    for i = 1, #last, 2 do
      local l = string.match(last[i], '^(.*):')
      if l ~= own and not others[l] then
        others[l], n = true, n + 1
      end
    end
    return n == WARM_PACERS
  end
  return false
end

-- pace_warm_start paces the guarded logs of the script's one call while
-- the quota warms up, when the other replicas crowd them (see above).
local function pace_warm_start(batch)
  if not batch.warming or batch.ncalls ~= 1 or OFF.warm_pacing then
    return
  end
  local c = batch.call_args[1]
  local own = string.match(c.id, '^(.*):')
  for _, r in ipairs(batch.scopes[c.scope].rs) do
    if r.kind == LOG and r.margin >= GUARDED and not r.pace then
      local pace = math.floor((r.window - r.margin) / r.limit)
      if crowded(r, own, pace) then
        r.pace = pace
      end
    end
  end
end

-- Classes. The calls of a quota fall into classes: their priority and,
-- under a rule that every key shares, their key ("<priority>/<key>"; a
-- rule per key drops the key). Each log or counter rule keeps in its ':cl'
-- hash the units each class booked, by the period of a quarter window of
-- their slots, for a window and a half and as far ahead as they are
-- booked, and the units of its calls that had to wait or were refused, by
-- the period they asked in: a class's demand is the most it booked in a
-- run of four periods from four periods ago on (scaled up to a window
-- while it is younger than one), and what of it waited in the last
-- window. Where a quota serves several classes, a call books, besides every rule of its
-- scope, in a log (or counter) of its class alone, whose limit is the
-- rule's less what it holds for the classes that rank above the call's
-- (class_hold): the whole demand of every higher priority (a tenth of
-- the limit at least for one younger than a window); at its own
-- priority, each lighter class's demand up to the max-min fair share of
-- what the higher ones leave; and, while the call's class alone could
-- fill the rule, a tenth of it for the lower priorities that call at all.
-- A thirty-second and one unit more covers the jitter of their calls. So a
-- class above finds its share free whenever it comes, and the call takes
-- every unit left but that spare; every class keeps at least a tenth of
-- the limit, so none starves for ever. A quota of one class (every call
-- of priority 0, no key) reads nothing more: the meta says until when some
-- class called (classes_until in lib.lua), and the ':cl' and ':c:' keys
-- are touched only by a quota that serves classes.
-- A booking given back, or settled at another cost, changes its class's
-- log and demand with the rule's (change_classes in lib.lua). The rule's
-- own log still holds every call: a class's log only ever narrows what
-- its calls may take, so a class measured wrong costs that class room,
-- never the cap.
local CLASS_KEPT = 6
local CLASS_FLOOR = 10
local CLASS_TTL = 60000
-- The field of ':cl' that keeps the period a new class was last told in
-- (announce_class); no class's name starts with '~'.
local CLASS_TOLD = '~told'

-- read_class reads class name of rule r from its field v of ':cl': into
-- r.cls, or r.cls_gone when no period of it is left from oldest on.
local function read_class(r, name, v, oldest)
  local c, any = { p = {}, w = {}, a = {}, prio = tonumber(string.match(name, '^(%-?%d+)') or '0') }, false
  for pi, u, w, a in string.gmatch(v, CLASS_PART) do
    pi = tonumber(pi)
    if pi >= oldest then
      c.p[pi], c.w[pi], c.a[pi], any = tonumber(u), tonumber(w), tonumber(a) or 0, true
    end
  end
  if any then
    r.cls[name] = c
  else
    r.cls_gone[#r.cls_gone + 1] = name
  end
end

-- read_classes reads, once per script, the classes of rule r: r.cls maps
-- each class's name to its priority and its units by period (p); the
-- classes with no period left go to r.cls_gone.
local function read_classes(r)
  if r.cls then
    return
  end
  r.cls, r.cls_gone, r.cls_add = {}, {}, {}
  local raw = redis.call('HGETALL', r.key .. ':cl')
  local oldest = class_period(r, now) - CLASS_KEPT
  for i = 1, #raw, 2 do
    if raw[i] == CLASS_TOLD then
      r.cls_told = tonumber(raw[i + 1])
    else
      read_class(r, raw[i], raw[i + 1], oldest)
    end
  end
end

-- demand returns the units per window in force class c of rule r books,
-- in thousandths: the most in four periods in a row from four periods
-- before the current one on, scaled up to a window while c is younger
-- than one (c.young), with what of it waited in the last
-- window, scaled to the window's margin. Thousandths, rounded down at
-- each step, keep every sum exact.
local function demand(r, c)
  if c.d then
    return c.d
  end
  local ps = {}
  for pi in pairs(c.p) do
    ps[#ps + 1] = pi
  end
  table.sort(ps)
  local d = 0
  local cur = class_period(r, now)
  for i = 1, #ps do
    if ps[i] >= cur - CLASS_PERIODS then
      local sum, j = 0, i
      while j <= #ps and ps[j] < ps[i] + CLASS_PERIODS do
        local u = c.p[ps[j]]
        if ps[j] <= cur - CLASS_PERIODS and not OFF.class_backlog then
          -- Units booked ahead into the oldest period the runs read, a
          -- window back: a backlog served and leaving the window, not
          -- what the class books by a window. In a later period it still
          -- fills the window, and the class's next calls need the room
          -- beside it.
          u = math.max(u - (c.a[ps[j]] or 0), 0)
        end
        sum, j = sum + u, j + 1
      end
      d = math.max(d, sum)
    end
  end
  local age = math.max(ps[#ps], cur) - ps[1] + 1
  d = d * 1000
  c.young = age < CLASS_PERIODS
  if c.young then
    d = math.floor(d * CLASS_PERIODS / age)
  end
  -- What waited, or was refused, in the last window, on top: a class
  -- refused at once (FailFast) shows its demand only so; a class whose calls
  -- queue for the next free slot books them all there, where they fill
  -- its share, and the calls after them wait in turn; the larger share
  -- lets the queue drain within a window.
  for pi = cur - CLASS_PERIODS + 1, cur do
    d = d + (c.w[pi] or 0) * 1000
  end
  -- Four periods span the window the vendor counts; the window in force,
  -- its margin included, holds that much more of an even stream.
  c.d = math.floor(d * r.window / span_of(r))
  return c.d
end

-- fair_share returns the max-min fair share of room among demands ds: the
-- level under which each demand is met whole, and above which every
-- larger one gets the level.
local function fair_share(ds, room)
  table.sort(ds)
  for i, d in ipairs(ds) do
    local level = math.floor(room / (#ds - i + 1))
    if d > level then
      return level
    end
    room = room - d
  end
  return NEVER
end

-- class_hold returns the units rule r holds, against a call of class name
-- and priority prio, for the classes that rank above it (see Classes).
local function class_hold(r, name, prio)
  local own = r.cls[name]
  local mine = own and demand(r, own) or 0
  local floor = math.max(math.floor(r.limit / CLASS_FLOOR), 1)
  local above, lower, peers, lighter = 0, 0, { mine }, {}
  for n, c in pairs(r.cls) do
    if n ~= name then
      local d = demand(r, c)
      if c.prio > prio then
        -- A higher class younger than a window has shown too little of
        -- its demand to hold it: a tenth of the limit at least.
        above = above + (c.young and math.max(d, floor * 1000) or d)
      elseif c.prio < prio then
        lower = lower + math.min(d, floor * 1000)
      else
        peers[#peers + 1] = d
        if d < mine then
          lighter[#lighter + 1] = d
        end
      end
    end
  end
  local hold = above
  local fair = fair_share(peers, math.max(r.limit * 1000 - above, 0))
  for _, d in ipairs(lighter) do
    hold = hold + math.min(d, fair)
  end
  if mine + hold >= (r.limit - floor) * 1000 then
    hold = hold + lower
  end
  if hold == 0 then
    return 0
  end
  hold = math.ceil(hold / 1000)
  return math.min(hold + math.floor(hold / 32) + 1, r.limit - floor)
end

-- class_rule returns the rule of class name under rule r: a log or
-- counter of that class's calls alone, read once per script and written
-- with the batch's other rules.
local function class_rule(batch, r, name)
  r.vrules = r.vrules or {}
  local v = r.vrules[name]
  if v then
    return v
  end
  v = {}
  for k, x in pairs(r) do
    v[k] = x
  end
  v.key = r.key .. ':c:' .. name
  v.cls, v.cls_gone, v.cls_add, v.vrules = nil, nil, nil, nil
  v.hint, v.hint_changed, v.fits, v.seg, v.pending, v.added = nil, nil, nil, nil, nil, nil
  v.recorded, v.at, v.at_str, v.long, v.cap, v.oth = nil, nil, nil, nil, nil, nil
  load(v)
  r.vrules[name] = v
  batch.objs[#batch.objs + 1] = v
  return v
end

-- classes_until makes the quota's meta say that rule r may hold shares
-- for classes until two windows after t: a call of the default class
-- ("0") reads the classes only until then, once every period of the last
-- class's demand has passed.
local function classes_until(batch, r, t)
  local m = batch.meta
  m.classes_until = math.max(m.classes_until, math.max(t, now) + 2 * span_of(r))
end

-- announce_class tells the fleet that class name, which rule r had not
-- seen, calls: the calls the rule booked ahead before it held nothing for
-- it, and book again when they wake at their slots (announce_lowered),
-- against the share the rule now holds for it; a higher class's calls, or
-- a light key's, then find that share in the window those bookings would
-- have filled. Once a period per rule at most, and only while the rule
-- holds bookings ahead: each sleeping call books again once per
-- announcement it slept through.
local function announce_class(batch, r, name)
  if OFF.class_news or r.cls[name] or r.cls_add[name] then
    return
  end
  local cur = class_period(r, now)
  if (r.cls_told or cur - 1) >= cur or not booked_ahead({ r }, now) then
    return
  end
  r.cls_told = cur
  redis.call('HSET', r.key .. ':cl', CLASS_TOLD, cur)
  announce_lowered(batch.meta, now, r.shared)
end

-- A class's calls are logged in its own log from its first (with nothing
-- held against them, logged and not searched), so that a share held
-- against it later counts what it took before. The default class ('0')
-- calls alone unlogged: a quota of one class reads and writes nothing
-- more. So when a class first calls under a rule whose classes noted none
-- in the periods kept, every entry of the rule in the widest window that
-- may count it is a call of the default class: fill_default copies those
-- up to now (a counter's buckets up to now's) into its log, the newest
-- BACKFILL at most, before any call books in it. A copied entry given
-- back would stay in that log until it left the window, and the calls
-- booked ahead book again as they wake (announce_class): copied too, each
-- would count twice in the window it books again in, and the default
-- class would lose that much of its room for a window. So they are not:
-- one of a process that missed the news counts in the rule alone, which
-- costs the classes above room, never the cap.
local BACKFILL = 4096

local function fill_default(r)
  if r.filled or OFF.class_logs then
    return
  end
  r.filled = true
  flush(r)
  local to, latest = r.key .. ':c:0', nil
  if r.kind == LOG then
    local lo, hi = '(' .. str(now - r.keep), str(now)
    local n = redis.call('ZCOUNT', r.key, lo, hi)
    local raw = redis.call('ZRANGEBYSCORE', r.key, lo, hi, 'WITHSCORES', 'LIMIT', math.max(n - BACKFILL, 0), BACKFILL)
    local args = {}
    for i = 1, #raw, 2 do
      args[#args + 1], args[#args + 2] = raw[i + 1], raw[i]
      if #args >= 1000 or i + 1 == #raw then
        redis.call('ZADD', to, unpack(args))
        args = {}
      end
      latest = tonumber(raw[i + 1])
    end
    if latest then
      expire(to, math.max((latest - now + r.keep) / 1000, CLASS_TTL))
    end
  elseif r.kind == COUNTER then
    local raw, upto, args = redis.call('HGETALL', r.key), bucket_of(now, r.width), {}
    for i = 1, #raw, 2 do
      if tonumber(raw[i]) <= upto then
        args[#args + 1], args[#args + 2] = raw[i], raw[i + 1]
        latest = math.max(latest or 0, (tonumber(raw[i]) + 1) * r.width)
      end
    end
    if latest then
      redis.call('HSET', to, unpack(args))
      expire(to, math.max((latest - now + r.keep + r.width) / 1000, CLASS_TTL))
    end
  end
end

-- class_rules adds to call's rules the rule of its class under each log
-- and counter that serves several classes, with the limit that leaves the
-- classes above it their share, and notes in call.classes where its units
-- count towards its class's demand.
local function class_rules(batch, call)
  if OFF.classes or call.class == '' then
    return
  end
  local rs
  for _, r in ipairs(call.rs) do
    if (r.kind == LOG or r.kind == COUNTER) and not r.class_of then
      local name = class_name(r, call.class, call.prio)
      if name ~= '0' then
        classes_until(batch, r, now)
      end
      if name ~= '0' or batch.meta.classes_until > now then
        read_classes(r)
      end
      if name ~= '0' then
        announce_class(batch, r, name)
        if not next(r.cls) then
          fill_default(r)
        end
      end
      if r.cls and (next(r.cls) or name ~= '0') then
        call.classes = call.classes or {}
        local cc = { r = r, name = name }
        call.classes[#call.classes + 1] = cc
        local hold = class_hold(r, name, call.prio)
        cc.logged = hold > 0 or not OFF.class_logs
        if cc.logged then
          local v = class_rule(batch, r, name)
          v.class_of = r
          local lim = math.max(r.limit - hold, units(r, call.cost))
          if v.limit ~= lim then
            v.limit, v.fits = lim, nil
          end
          if hold > 0 then
            rs = rs or { unpack(call.rs) }
            rs[#rs + 1] = v
          else
            -- Nothing held against it: logged, not searched.
            call.also = call.also or {}
            call.also[#call.also + 1] = v
          end
        end
      end
    end
  end
  call.rs = rs or call.rs
end

-- note_classes adds the units of call to its classes' demand: booked at
-- t, or refused (t nil). A call that waits, or is refused, counts among
-- the units that waited too.
local function note_classes(batch, call, t)
  for _, cc in ipairs(call.classes or {}) do
    local r = cc.r
    if t and cc.name ~= '0' then
      classes_until(batch, r, t)
    end
    local add = r.cls_add[cc.name] or { p = {}, w = {}, a = {} }
    r.cls_add[cc.name] = add
    local u = units(r, call.cost)
    if t then
      local pi = class_period(r, t)
      add.p[pi] = (add.p[pi] or 0) + u
      if t > now then
        add.a[pi] = (add.a[pi] or 0) + u
      end
    end
    if not t or t > now then
      local pi = class_period(r, now)
      add.w[pi] = (add.w[pi] or 0) + u
    end
  end
end

-- write_classes writes back the classes of rule r that the batch booked
-- in, and drops those with no period left; the hash lives a window and a
-- half past its latest booking.
local function write_classes(r)
  if not r.cls_add then
    return
  end
  -- In chunks, as zadd in lib.lua: thousands of keys' classes may leave in one period.
  for i = 1, #r.cls_gone, 1000 do
    redis.call('HDEL', r.key .. ':cl', unpack(r.cls_gone, i, math.min(i + 999, #r.cls_gone)))
  end
  local oldest, latest = class_period(r, now) - CLASS_KEPT, nil
  for name, add in pairs(r.cls_add) do
    local c = r.cls[name] or { p = {}, w = {}, a = {} }
    local parts = {}
    for pi, u in pairs(add.p) do
      c.p[pi] = (c.p[pi] or 0) + u
    end
    for pi, u in pairs(add.a) do
      c.a[pi] = (c.a[pi] or 0) + u
    end
    for pi, w in pairs(add.w) do
      c.p[pi] = c.p[pi] or 0
      c.w[pi] = (c.w[pi] or 0) + w
    end
    for pi, u in pairs(c.p) do
      if pi >= oldest then
        parts[#parts + 1] = class_part(pi, u, c.w[pi] or 0, c.a[pi] or 0)
        latest = math.max(latest or pi, pi)
      end
    end
    redis.call('HSET', r.key .. ':cl', name, table.concat(parts, ','))
  end
  if latest then
    local period = math.max(math.floor(span_of(r) / CLASS_PERIODS), 1)
    local ms = ((latest + 1) * period - now + span_of(r) * CLASS_KEPT / CLASS_PERIODS) / 1000
    expire(r.key .. ':cl', math.max(ms, CLASS_TTL))
  end
end

-- leave_classes takes the bookings given back out of their classes'
-- demand, once the calls are decided and the classes written: read while
-- the calls were decided, a class whose calls all book again at once
-- would have shown no demand, and held no share.
local function leave_classes(batch)
  for _, b in pairs(batch.given) do
    change_classes(b.scope.rs, b.id, b.cost, NONE, b.slot, b, now, 'demand')
  end
end

-- read_call reads call c of the batch, with the units still free under the
-- tightest rule of its scope, now (remaining) and once it is in (after),
-- its class's own log included, and the same of the rules alone (room,
-- room_after). It returns, instead, an error reply for a call that costs
-- more than a rule's configured limit.
local function read_call(batch, c)
  local call = call_args(batch, c)
  class_rules(batch, call)
  for _, r in ipairs(call.rs) do
    local u = units(r, call.cost)
    if r.conf < u then
      return nil, redis.error_reply('cost ' .. u .. ' exceeds limit ' .. r.conf)
    elseif r.limit < u then
      -- Only while the quota is reserved, or a learned cap is below cost.
      call.too_big = true
    end
    -- Units free under the tightest rule, and once the call is in.
    local f = free(r)
    call.remaining = math.min(call.remaining, math.max(f, 0))
    call.after = math.min(call.after, math.max(f - u, 0))
    if not r.class_of then
      -- The rule's own room, which a vendor's count is read against.
      call.room = math.min(call.room, math.max(f, 0))
      call.room_after = math.min(call.room_after, math.max(f - u, 0))
    end
  end
  if call.pause > now then
    -- Nothing is free while the vendor asked for quiet.
    call.remaining, call.after, call.room, call.room_after = 0, 0, 0, 0
  end
  return call
end

-- start_from returns the time from which the rules look for the call's
-- slot, no earlier than its lead from now and its scope's pause, and
-- whether they are to look at all.
local function start_from(batch, call)
  local t = math.max(now + call.lead, call.pause)
  if not call.too_big then
    return t, true
  end
  for _, r in ipairs(call.rs) do
    if (r.whole and r.whole.limit or r.limit) < units(r, call.cost) then
      -- Larger than a learned cap: no slot can be booked under a cap that
      -- may not rise: refused, with a hint of when it may have.
      call.maxwait = -1
      return math.max(t, r.cap and r.cap.next + span_of(r) or t), false
    end
  end
  -- Larger than the reserved share only: no slot can be booked while
  -- replicas still deciding without Redis may yet hand back calls they
  -- booked ahead, at times any slot booked now could share a window with.
  -- Refused, with the reserve's end for when to ask again: every replica
  -- has handed back by then.
  call.reserved_until = batch.meta.reserved_until
  return NEVER, false
end

-- paced_all returns the earliest time >= t that every paced log of rules
-- rs allows (see paced).
local function paced_all(rs, t)
  local p = t
  for _, r in ipairs(rs) do
    if r.pace and r.pace > 0 then
      p = math.max(p, paced(r, t))
    end
  end
  return p
end

-- settle returns the earliest time from t on that every rule of the call
-- allows, paced where the call may wait that long; NEVER when a rule
-- cannot say. Each rule can only push the time later, and only to one of
-- finitely many times, so this settles; should the rules push each other
-- on for long, the logs settle for their tails, which no rule pushes
-- further.
local budget = { left = SCAN } -- each call's, set anew by settle

local function settle(call, t, moved)
  budget.left = SCAN
  local rounds = 0
  local paces, unpaced = call.maxwait > 0 and 2 or 0, nil
  while moved and t < NEVER do
    moved = false
    rounds = rounds + 1
    if rounds > 16 then
      budget.left = 0
    end
    for _, r in ipairs(call.rs) do
      local u = earliest(r, t, units(r, call.cost), budget)
      if u > t then
        t = u
        moved = true
        if t == NEVER then
          break
        end
      end
    end
    if not moved and paces > 0 and t < NEVER then
      -- Paced once the rules agree, if the call may wait that long; the
      -- rules then settle again from the paced time, within a short read:
      -- the time the rules agreed on was room left among the log's
      -- bookings (a booking given back), and the paced time lies among
      -- them too, where a log booked far ahead would be read to its end.
      -- Past that read, the log settles for its tail, which is paced once
      -- more.
      paces = paces - 1
      local p = paced_all(call.rs, t)
      if p > t and p - now <= call.maxwait then
        unpaced, t, moved = unpaced or t, p, true
        budget.left = math.min(budget.left, PACED_SCAN)
      end
    end
  end
  if unpaced and t - now > call.maxwait then
    -- Pacing is a preference: it never refuses a call that fits.
    t = unpaced
  end
  return t
end

-- busy_for returns how long until a slot may free for a call of cost that
-- the concurrency rules of rs cannot take: the first lease to run out in
-- each full rule, the latest of those.
local function busy_for(rs, cost)
  local hint = 0
  for _, r in ipairs(rs) do
    if r.kind == CONCURRENCY and r.n + units(r, cost) > r.limit then
      flush(r)
      local head = redis.call('ZRANGE', r.key, 0, 0, 'WITHSCORES')
      local free_at = r.lost_until or tonumber(head[2] or now)
      hint = math.max(hint, free_at - now)
    end
  end
  return hint
end

-- blind.cause returns why a blind rule of the call refused it (PAUSED_BY_*
-- in lib.lua), or 0: busy, a concurrency rule taken for a lease; else a
-- log or counter that admits nothing within the wait the call accepts.
function blind.cause(call, busy)
  for _, r in ipairs(call.rs) do
    if r.blind and busy == (r.kind == CONCURRENCY) and
        (busy or r.kind ~= BUCKET and blind.floor(r) - now > call.maxwait) then
      return r.blind_by
    end
  end
  return 0
end

-- blind.scouts reports whether the call, admitted at t, is a scout: a blind
-- log or counter takes it before its blindness ends.
function blind.scouts(call, t)
  for _, r in ipairs(call.rs) do
    if r.blind and (r.kind == LOG or r.kind == COUNTER) and t < r.blind_until then
      return true
    end
  end
  return false
end

-- answer appends a call's answer to the reply (see the header), with the
-- units free its call.remaining and call.room say.
local function answer(batch, call, admitted, wait, reason, blind_by)
  local out = batch.out
  local n = #out
  out[n + REPLY.answer.admitted] = admitted
  out[n + REPLY.answer.wait] = wait == 0 and 0 or str(wait)
  out[n + REPLY.answer.remaining] = call.remaining
  out[n + REPLY.answer.reason] = reason
  out[n + REPLY.answer.blind_by] = blind_by or 0
  out[n + REPLY.answer.pause] = call.pause == 0 and 0 or str(call.pause)
  local noted, logged = 0, 0
  if admitted == 1 then
    for _, cc in ipairs(call.classes or {}) do
      noted = noted + 2 ^ (cc.r.i - 1)
      logged = logged + (cc.logged and 2 ^ (cc.r.i - 1) or 0)
    end
  end
  out[n + REPLY.answer.noted], out[n + REPLY.answer.logged], out[n + REPLY.answer.room] = noted, logged, call.room
end

-- decide decides call c of the batch and appends its answer to the reply:
-- refused, with when it would fit, or recorded in every rule of its scope
-- at its slot. A call that moves its booking and finds nothing earlier
-- than its slot keeps that slot: given back and taken again, it leaves
-- every window as it found it. It returns, instead, an error reply for a
-- call no rule can ever take.
local function decide(batch, c)
  local call, err = read_call(batch, c)
  if err then
    return err
  end
  local t, moved = start_from(batch, call)
  t = settle(call, t, moved)
  local refused = call.reserved_until or t == NEVER or t - now > call.maxwait
    or call.moves and t >= call.moves.slot
  if call.moves and refused then
    t, refused, call.moves.kept = call.moves.slot, false, true
  end
  if refused then
    note_classes(batch, call, nil)
  end
  if call.reserved_until and refused then
    answer(batch, call, 0, call.reserved_until - now, REASON.share)
  elseif t == NEVER then
    answer(batch, call, 0, busy_for(call.rs, call.cost), REASON.busy, blind.cause(call, true))
  elseif refused then
    answer(batch, call, 0, t - now, REASON.too_far, blind.cause(call, false))
  else
    local scout = blind.scouts(call, t)
    for _, r in ipairs(call.rs) do
      record(r, t, call.id, units(r, call.cost))
    end
    for _, v in ipairs(call.also or {}) do
      record(v, t, call.id, units(v, call.cost))
    end
    note_classes(batch, call, t)
    batch.units = batch.units + call.cost.total
    call.remaining, call.room = call.after, call.room_after
    if t > now or call.moves and call.moves.kept then
      call.remaining, call.room = 0, 0
    end
    if scout then
      -- Any count the vendor gives of a scout is news (see Scouts in lib.lua).
      call.room = -1
    end
    if t <= now then
      batch.at_once = true
    end
    answer(batch, call, 1, t - now, REASON.admitted)
  end
end

-- write_back_meta writes the meta back, holding what the calls decided
-- need held: the calls admitted at once while the quota warms up, and the
-- spread they were booked with (see Holds in lib.lua). Every acquire
-- script writes it, since its count of scripts run moves. A loss found, or
-- a pause that grew, is told to the fleet.
local function write_back_meta(batch)
  local meta, latest = batch.meta, 0
  for _, r in ipairs(batch.objs) do
    if r.recorded then
      latest = math.max(latest, r.tmax)
    end
  end
  if batch.warming and batch.at_once then
    meta.warm_held = math.max(meta.warm_held, now + warm_hold(batch.rs))
  end
  if latest > 0 then
    hold_spread(meta, now, batch.spread, latest, batch.rs)
  end
  write_meta(meta, batch.rs)
  if batch.found or meta.pause > batch.pause_before and meta.pause > now then
    announce_quota(meta, now)
  end
end

-- write_back_rules writes what the calls recorded in every rule, and the
-- logs' hints that moved. Each key must outlive its latest entry by a
-- window.
local function write_back_rules(objs)
  for _, r in ipairs(objs) do
    flush(r)
    write_classes(r)
    if r.hint_changed then
      write_hint(r, now)
    end
    -- A class's log is written only by its own calls while a share is
    -- held against them: kept a minute at least, so that a Redis whose
    -- clock runs apart from the one the scripts are given (see SLACK) does
    -- not drop it between two of them.
    local least = r.class_of and CLASS_TTL or 0
    if not r.recorded then
      -- nothing to keep
    elseif r.kind == LOG then
      expire(r.key, math.max((r.tmax - now + r.kept) / 1000, least))
    elseif r.kind == COUNTER then
      expire(r.key, math.max((r.tmax - now + r.kept + r.width) / 1000, least))
    elseif r.kind == CONCURRENCY then
      expire(r.key, (r.tmax - now + r.lease) / 1000)
    end
  end
end

local batch = read_args()
check_meta(batch, read_fleet(batch))
-- Limits the vendor taught the fleet (see read_caps in lib.lua).
read_caps(batch.objs, batch.meta, now)
reserve(batch)
give_back_bookings(batch)
load_rules(batch)
pace_warm_start(batch)
-- The reply's header (see the top); done is known only once the calls
-- are decided and written.
local quota_paused = batch.meta.pause > now
batch.out = {}
batch.out[REPLY.acquire.now], batch.out[REPLY.acquire.pause] = str(now), str(batch.scopes[1].pause)
batch.out[REPLY.acquire.epoch], batch.out[REPLY.acquire.lost] = str(batch.meta.epoch), batch.found and 1 or 0
batch.out[REPLY.acquire.margin], batch.out[REPLY.acquire.done] = str(batch.margin), 0
batch.out[REPLY.acquire.seq] = str(batch.meta.seq)
batch.out[REPLY.acquire.paused] = quota_paused and str(batch.meta.pause) or 0
batch.out[REPLY.acquire.paused_by] = quota_paused and batch.meta.paused_by or 0
for c = 0, batch.ncalls - 1 do
  local err = decide(batch, c)
  if err then
    return err
  end
end
write_back_meta(batch)
write_back_rules(batch.objs)
leave_classes(batch)
local long = batch.ncalls > LONG_CALLS or batch.units > LONG_WORK
for _, r in ipairs(batch.objs) do
  long = long or r.long
end
batch.out[REPLY.acquire.done] = (long or OFF.lazy_done) and str(clock()) or str(now)
return batch.out
