-- feedback.lua: what the vendor said, made known to the whole fleet.
--
-- KEYS and ARGV as in lib.lua; the rules passed are the ones the vendor's
-- answer is about (the shared ones, or the ones of one key); after them
-- ARGS.feedback, with
--   as_of     the time, in microseconds, of the call whose answer carried the
--             vendor's count, or 0 for now: units after it are calls on their way
--             that the vendor has not counted yet;
--   pause     a pause in microseconds from now (a 429 with Retry-After): no call
--             in the scope of KEYS[2] is admitted before it ends; 0 for none. A
--             pause only ever lengthens one already in force.
--   left      the units the vendor says are left, or -1 when it did not say.
--   reset     microseconds until the vendor's window resets, or 0 when unknown;
--   known     the quota's epoch as the calling process last saw it, or
--             0: a pause must not hide a loss of the quota's data (see check_loss);
--   refused   1 when the vendor refused the call of as_of for being over its
--             limit, so that the rules learn a cap (see learn_cap in lib.lua), else 0;
--   limit     the limit the vendor stated with its refusal, or 0; then the same
--             three of the vendor's counts of requests, for the rules that count calls
--             (see units in lib.lua): calls_left (or -1), calls_reset (or 0),
--             calls_limit (or 0);
--   late      how long after its slot the answer to the call of as_of came, in
--             microseconds (0 when unknown): the vendor took its counts at the
--             latest then, with the fleet's calls in flight at their estimate;
--   refused_cost  when the vendor refused the call of as_of, its cost (as
--             read_cost in lib.lua reads it, under the rules passed), else "";
--   span      the longest window of the whole policy in microseconds, its margin's
--             ceiling included: a loss this script finds counts every rule as full for it;
--   named     the number of ARGS.named that follow.
-- left, reset and the limit speak of the other rules, but for those that
-- count a named unit (policies.Unit): for each, ARGS.named, its place among
-- the rules (from 1), the units of it left (or -1) and microseconds until
-- their reset (or 0): each such rule follows its own count alone. A count
-- taken by several rules is about those of its limit (about_rules).
--
-- When the vendor has fewer units left than a rule believes (another consumer
-- of the same API key, a restart), the rule is charged the difference, under
-- id, so that the fleet slows down before the vendor answers 429. The
-- charge leaves the rule's window when the vendor's window resets. The
-- charges of a rule are also listed in r.key .. ':ch' (member "id:units",
-- scored by the time they sit at): a charge may sit after the time of the
-- next answer's call, and the next answer must count it all the same, or
-- the answers of calls in flight together would each charge the gap again.
--
-- Each count also measures what other consumers of the key spend (see
-- Others' share in lib.lua, and note_others below).
--
-- When a rule's limit in force drops (a cap learned, a larger share left to
-- others), the fleet is told (announce_lowered in lib.lua): calls booked
-- before the drop, against the limit before it, book again at their slots.
--
-- Returns REPLY.feedback {now, pause until (or 0), units charged, lowered,
-- cap, others, measuring, dropped},
-- the time and the pause first as in every script's reply that has them:
-- lowered is 1 when a rule's cap dropped; cap the lowest limit in force of
-- a capped rule, or -1 when no rule is capped; others the most units a rule
-- leaves other consumers of the key (others_reserve), or 0; dropped 1
-- when a rule's limit in force dropped; measuring 1
-- while a rule keeps a share, which every count the vendor gives should
-- measure, not only those that say fewer are left than the fleet believed.

local now = clock()
-- The arguments, read once (see the header).
local a = after_rules()
local arg
arg, a = ARGS.feedback(a)
arg.late = math.max(arg.late, 0)
local id, pause, left, reset = arg.id, arg.pause, arg.left, arg.reset
-- The counts of the rules that count a named unit, by their place.
local own = {}
for _ = 1, arg.named do
  local n
  n, a = ARGS.named(a)
  own[n.rule] = { left = n.left, reset = n.reset }
end
-- The longest window of the whole policy, margin ceiling included: a loss
-- this script finds pauses the quota for it (see loss_pause).
local policy_span = arg.span
local as_of = arg.as_of
if as_of <= 0 or as_of > now then
  as_of = now
end

local rs = rules()
local meta = read_meta(true)
-- The record was kept for the lag in force until now; this answer's
-- lateness, until this script ran, holds it for the next ones (Answers'
-- lag in lib.lua).
margins(rs, fleet_spread(meta, now), held_spread(meta, now), meta and meta.warm_held > now, lag_of(meta, now))
local lag_changed = note_lag(meta, math.max(arg.late, arg.as_of > 0 and now - as_of or 0), arg.span, now)
local known = arg.known
local learn = arg.refused and arg.as_of > 0
local dirty, found = false, false
if meta or learn or pause > 0 and KEYS[2] == KEYS[1] then
  meta, dirty, found = check_loss(meta, now, known, rs, policy_span)
end
dirty = dirty or lag_changed
read_caps(rs, meta, now)
-- Which rules are blind (see Blind rules in lib.lua): their record misses
-- calls the vendor counts, so it measures no others, and a count may
-- rebuild it (see rebuild below).
for _, r in ipairs(rs) do
  blind.read(r, meta, now)
end
-- Each rule's count: the vendor's units, its requests for a rule that
-- counts calls, a named unit's own.
local function count_of(i, r)
  if r.per_call then
    return 'calls', arg.calls_left, arg.calls_reset, arg.calls_limit
  elseif own[i] then
    return 'own' .. i, own[i].left, own[i].reset, 0
  end
  return 'units', left, reset, arg.limit
end

-- takers lists, for each count, the places of the rules that take it.
local takers = {}
for i, r in ipairs(rs) do
  if r.kind ~= CONCURRENCY then
    local which = count_of(i, r)
    takers[which] = takers[which] or {}
    table.insert(takers[which], i)
  end
end

-- about_rules returns the places, among is (the takers of one count), of
-- the rules the count is about: the one rule that takes it; else those
-- whose limit it states (as configured or in force); else, when it states
-- none, those of the shortest window its reset fits in (the longest
-- window when none holds it, the shortest when it gives no reset). One
-- count taken for every rule would measure, or charge, a rule by another
-- limit's calls: GitHub's core count of 5,000 calls an hour, read by a
-- quota that also keeps content creation's 80 a minute, measured its
-- minute's others as what the hour counted beyond the minute's calls.
local function about_rules(is, reset, vlimit)
  if #is <= 1 or OFF.about then
    return is
  end
  local out = {}
  if vlimit > 0 then
    for _, i in ipairs(is) do
      if rs[i].conf == vlimit or rs[i].limit == vlimit then
        table.insert(out, i)
      end
    end
    return out
  end
  local fit, longest
  for _, i in ipairs(is) do
    local w = span_of(rs[i])
    if w >= reset and (not fit or w < fit) then
      fit = w
    end
    longest = math.max(longest or w, w)
  end
  for _, i in ipairs(is) do
    if span_of(rs[i]) == (fit or longest) then
      table.insert(out, i)
    end
  end
  return out
end

-- about[i] says whether rule i's count is about it.
local about = {}
for which, is in pairs(takers) do
  local _, _, rst, vlimit = count_of(is[1], rs[is[1]])
  for _, i in ipairs(about_rules(is, rst, vlimit)) do
    about[i] = true
  end
end

-- dropped_shared: a shared rule's limit in force dropped, which the
-- group hears (see announce_lowered).
local lowered, dropped, dropped_shared = 0, 0, false
if learn then
  local cu = meta.caps_until
  for _, r in ipairs(rs) do
    local vlimit = r.per_call and arg.calls_limit or arg.limit
    if r.kind ~= CONCURRENCY and (vlimit <= 0 or about[r.i]) and learn_cap(r, as_of, meta, now, vlimit) then
      lowered, dropped, dropped_shared = 1, 1, dropped_shared or r.shared
    end
  end
  dirty = dirty or meta.caps_until ~= cu
end
-- listed_in returns the units listed in key (members "id:units", scored
-- by the time they sit at) that sit in (lo, hi], or after lo for no hi.
local function listed_in(key, lo, hi)
  local n = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', key, '(' .. str(lo), hi and str(hi) or '+inf')) do
    n = n + (tonumber(string.match(m, ':(%d+)$')) or 0)
  end
  return n
end

-- charged_in returns the units charged to rule r that sit in (lo, hi], or
-- after lo for no hi: in its record, but not sent by the fleet.
local function charged_in(r, lo, hi)
  return listed_in(r.key .. ':ch', lo, hi)
end

-- A call the vendor refused is still in the fleet's record (a vendor may
-- count refused calls too: the record errs on the safe side), but the
-- vendor's counts most often leave it out: it is listed in r.key .. ':rj'
-- (as a charge is in ':ch') for the measure of the others, which would
-- otherwise take each refused call of the fleet for room the others left,
-- and the next refusals would follow. A vendor that counts refused calls
-- is measured high while the fleet's calls are refused, which leaves
-- more room until they stop.
if arg.refused_cost ~= '' and arg.as_of > 0 and not OFF.others then
  local cost = read_cost(arg.refused_cost)
  for _, r in ipairs(rs) do
    local n = units(r, cost)
    if n > 0 and (r.kind == LOG or r.kind == COUNTER) then
      local key = r.key .. ':rj'
      redis.call('ZREMRANGEBYSCORE', key, '-inf', str(now - r.window))
      redis.call('ZADD', key, str(as_of), id .. ':' .. n)
      expire(key, (as_of - now + r.window) / 1000)
    end
  end
end

-- refunded_in returns the units of rule r refunded (settle.lua) since the
-- call of as_of, from calls booked in (lo, hi]: until such a call ended,
-- the vendor counted it at its estimate.
local function refunded_in(r, lo, hi)
  local n = 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', r.key .. ':rf', '(' .. str(as_of), '+inf')) do
    local t, u = string.match(m, '^(%-?%d+):.*:(%d+)$')
    t = tonumber(t)
    if t and t > lo and t <= hi then
      n = n + tonumber(u)
    end
  end
  return n
end

-- sent_in_window returns the units of rule r the fleet had sent in the
-- vendor's window when the vendor counted the call of as_of, at its
-- arrival: its record from a window before the call's slot to the call's
-- start (its slot and its own lateness), each bound widened by the
-- fleet's spread (calls booked a little earlier or later may have reached
-- the vendor in that window), charges aside, and the units refunded since
-- the slot still in (the vendor counted those calls as estimated), the
-- calls it refused aside. Each
-- bound errs towards more sent, so that a measure of the others errs low
-- rather than high.
local function sent_in_window(r, span)
  local d = math.max(fleet_spread(meta, now), r.margin / 4, 1000)
  local lo, hi = as_of - span - d, as_of + arg.late + d
  if as_of - span < now - r.kept and not OFF.lag then
    -- The record may have dropped part of the vendor's window: no measure
    -- (see Answers' lag in lib.lua).
    return nil
  end
  if r.kind == COUNTER then
    -- Every bucket the bounds touch counts whole.
    local n = 0
    local raw = redis.call('HGETALL', r.key)
    for k = 1, #raw, 2 do
      local b = tonumber(raw[k]) * r.width
      if b + r.width > lo and b <= hi then
        n = n + tonumber(raw[k + 1])
      end
    end
    lo, hi = lo - r.width, hi + r.width
    return n - charged_in(r, lo, hi) + refunded_in(r, lo, hi) - listed_in(r.key .. ':rj', lo, hi)
  end
  return redis.call('ZCOUNT', r.key, '(' .. str(lo), str(hi)) - charged_in(r, lo, hi) + refunded_in(r, lo, hi) -
    listed_in(r.key .. ':rj', lo, hi)
end

-- note_others measures, from the vendor's count of units left of a rule r
-- as of the call of as_of, what others spent in the vendor's window: what
-- the vendor counted (its limit, stated as vlimit or else the rule's, less
-- what is left) less what the fleet sent (sent_in_window), and adds the
-- measure to the others' share (see Others' share in lib.lua). A rule
-- with no share keeps none until a measure gives half a unit, and drops
-- its share when it falls under a tenth. It reports whether the share
-- changed.
local function note_others(r, left, vlimit)
  if OFF.others or not meta or r.blind or (r.kind ~= LOG and r.kind ~= COUNTER) then
    return false
  end
  local o = r.oth or { vlim = 0, p = {}, share = NO_MEASURE }
  if vlimit > 0 then
    o.vlim = vlimit
  end
  local base = o.vlim > 0 and o.vlim or (r.cap and r.cap.lim or r.conf)
  local sent = sent_in_window(r, span_of(r))
  if not sent then
    return false
  end
  local m = math.floor(1000 * (base - left - sent) + 0.5)
  local i = others_period(r, now)
  o.p[i] = math.max(o.p[i] or NO_MEASURE, m)
  others_share(r, o, now)
  if not r.oth and o.share < 500 then
    return false
  end
  r.oth = o
  if o.share < 100 then
    -- The others stopped, or were noise: the share goes.
    r.oth = nil
  end
  return true
end

-- Each count the vendor gave measures the others' share of its rules.
if meta and not learn then
  local cu = meta.caps_until
  for i, r in ipairs(rs) do
    local left, vlimit = arg.left, arg.limit
    if r.per_call then
      left, vlimit = arg.calls_left, arg.calls_limit
    elseif own[i] then
      left, vlimit = own[i].left, 0
    end
    local limit = r.limit
    if left >= 0 and about[i] and note_others(r, left, vlimit) then
      write_limits(r, meta, now)
      if r.limit < limit then
        dropped, dropped_shared = 1, dropped_shared or r.shared
      elseif r.limit > limit and r.kind == LOG then
        -- Room the share gave back: a log's hint may say nothing fits there.
        -- A counter keeps no hint, and its caller declares none.
        redis.call('DEL', r.key .. ':next')
      end
    end
  end
  dirty = dirty or meta.caps_until ~= cu
end

local announce = found
local until_ = pause_until(meta and meta.pause or 0)
if pause > 0 and now + pause > until_ then
  until_ = now + pause
  if KEYS[2] == KEYS[1] then
    meta.pause, meta.paused_by = until_, PAUSED_BY_VENDOR
    dirty, announce = true, true
  else
    announce_key(until_, now)
    redis.call('SET', KEYS[2], str(until_), 'PX', math.ceil(pause / 1000) + SLACK)
  end
end

-- The vendor states its counts: any process's calls may go out as scouts.
if meta and meta.counted == 0 and (left >= 0 or arg.calls_left >= 0 or arg.named > 0) then
  meta.counted, dirty = 1, true
end
if dirty then
  write_meta(meta, rs)
end
if announce then
  announce_quota(meta, now)
end
if dropped == 1 then
  announce_lowered(meta, now, dropped_shared)
end

-- charged_after returns the units charged to rule r that sit after time t
-- and within its window, and drops the charges that left it.
local function charged_after(r, t)
  if OFF.charges then
    return 0
  end
  redis.call('ZREMRANGEBYSCORE', r.key .. ':ch', '-inf', str(now - r.window))
  return charged_in(r, t)
end

-- The counts were taken at the latest when the answer came: the fleet's
-- calls booked until then are in them, at their estimate or max_tokens
-- while in flight, as they are in the fleet's record.
local taken = math.min(as_of + arg.late, now)
local charged = 0
local calls_left, calls_reset = arg.calls_left, arg.calls_reset
for i, r in ipairs(rs) do
  local left, reset = left, reset
  if r.per_call then
    left, reset = calls_left, calls_reset
  elseif own[i] then
    left, reset = own[i].left, own[i].reset
  end
  if left >= 0 and about[i] then
    local free
    -- What the rule held free in the window the vendor counted: from
    -- the call's arrival, the earliest it may have taken its counts (and
    -- as the measure of the others reads it), to the latest. From now's
    -- window instead, an answer that came a call's latency after its slot
    -- took the fleet's calls that left the window since for room the
    -- vendor still counted, and charged them: a tenth of an LLM fleet's
    -- window of 40 buckets, a call 100 ms long.
    local from = OFF.lag and now or as_of
    if r.kind == LOG then
      free = r.limit - redis.call('ZCOUNT', r.key, '(' .. str(from - r.window), str(taken)) - charged_after(r, taken)
    elseif r.kind == COUNTER then
      local used = 0
      local raw = redis.call('HGETALL', r.key)
      local oldest = oldest_bucket(r, from)
      for k = 1, #raw, 2 do
        local b = tonumber(raw[k])
        if b >= oldest and b * r.width <= taken then
          used = used + tonumber(raw[k + 1])
        end
      end
      free = r.limit - used - charged_after(r, bucket_of(taken, r.width) * r.width + r.width - 1)
    elseif r.kind == BUCKET then
      local tat = tat_of(r.key)
      free = bucket_free(r, tat, now)
    end
    -- A vendor's count that says fewer are left than the fleet believed
    -- leaves the others the spare of their share too: the fleet takes
    -- what the vendor says is left, but not its last units.
    left = math.max(left - (r.spare or 0), 0)
    if free and free > left then
      -- Charged units sit where they leave the window as the vendor's resets.
      local at = now
      if reset > 0 and r.kind ~= BUCKET then
        at = math.min(now, math.max(now + reset - r.window, now - r.window + 1))
      end
      change(r, id, 0, free - left, at, now)
      if r.kind ~= BUCKET then
        local key = r.key .. ':ch'
        redis.call('ZADD', key, str(at), id .. ':' .. str(free - left))
        redis.call('PEXPIRE', key, math.ceil((at - now + r.window) / 1000) + SLACK)
      end
      charged = math.max(charged, free - left)
    end
  end
end

-- Blind rules rebuilt. A rule is blind after a loss or a deploy that
-- added it (see Blind rules in lib.lua). A vendor's count of a call decided
-- once its data began speaks of what the vendor counts that the data does
-- not hold: the charge above took the data to it, so the rule, for the
-- key passed, decides with its data again (its :rb notes when). A count
-- rebuilds a rule only when it is the rule's: passed to that rule alone,
-- or stating the rule's limit, and resetting within its window (stated in
-- whole seconds). The call must have been decided in the epoch the caller
-- knows, once every call admitted before the data began had reached the
-- vendor (blind.settled): they are all in its count.
local RESET_SLACK = 1000000

-- rebuild ends the blindness of rule r from the vendor's count (left,
-- reset, the limit it stated), alone when no other rule passed takes the
-- same count, and reports whether it did.
local function rebuild(r, left, reset, vlimit, alone)
  if OFF.rebuild or left < 0 or arg.as_of <= 0 or not meta or known ~= meta.epoch then
    return false
  end
  if not r.blind or arg.as_of < blind.settled(r) or reset > span_of(r) + r.margin + RESET_SLACK or
      not alone and vlimit ~= r.conf then
    return false
  end
  redis.call('SET', r.key .. ':rb', str(now), 'PX', math.ceil((r.blind_until - now) / 1000) + SLACK)
  return true
end

local seen_until = 0
for i, r in ipairs(rs) do
  local which, l, rst, vlimit = count_of(i, r)
  if rebuild(r, l, rst, vlimit, #(takers[which] or {}) == 1) then
    seen_until = math.max(seen_until, r.blind_until)
  end
end
-- Calls booked to the end of the blindness may move to the room it left.
announce_room(meta, rs, seen_until, now)

local cap, others, measuring = -1, 0, 0
for _, r in ipairs(rs) do
  if r.cap and (cap < 0 or r.cap.lim < cap) then
    cap = r.cap.lim
  end
  if r.oth then
    others, measuring = math.max(others, r.reserve), 1
  end
end
local out = {}
out[REPLY.feedback.now], out[REPLY.feedback.pause], out[REPLY.feedback.charged] = str(now), str(until_), charged
out[REPLY.feedback.lowered], out[REPLY.feedback.cap], out[REPLY.feedback.others] = lowered, cap, others
out[REPLY.feedback.measuring], out[REPLY.feedback.dropped] = measuring, dropped
return out
