package throttle

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/redistest"
	"github.com/throttlekit/throttle/policies"
)

// Security tests: the library through a Redis that speaks TLS only, and as
// an ACL user that holds only the rights the README lists.

// securityWindow is the window of the quota that the paths fill and wait on.
const securityWindow = 300 * time.Millisecond

// securityPaths takes limiters on rdb through every path that reaches
// Redis: Allow, Acquire waiting in Block mode, a waiter giving its booking
// back, Do, Settle, Usage, SetRemaining, Pause, a Concurrency slot taken,
// extended and released, and a call through the Transport, whose vendor
// reports its remaining count. The quota combines every kind of rule, so
// that every command of the scripts runs. Paths whose errors the library
// swallows (a booking given back, a slot released) are checked through
// Usage.
func securityPaths(t *testing.T, rdb redis.UniversalClient) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	lim, err := New(rdb, "security", policies.All(
		policies.SlidingLog{Limit: securityLimit, Window: securityWindow},
		policies.SlidingCounter{Limit: 1000, Window: time.Second},
		policies.TokenBucket{Rate: 1000, Per: time.Second, Burst: 1000},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 1000, Window: time.Second}},
	))
	if err != nil {
		t.Fatal(err)
	}
	r := securityRig{t: t, ctx: ctx, lim: lim, key: Key("tenant-1")}
	r.waitsAndGivesUp()
	r.doesSettlesAndIsTold()
	r.holdsAConcurrencySlot(rdb)
	r.callsThroughTheTransport(rdb)
}

// securityLimit is the limit of the quota's log, the rule the paths fill.
const securityLimit = 3

// securityRig is what the steps of securityPaths share: the test, its
// deadline, and the quota that combines every kind of rule.
type securityRig struct {
	t   *testing.T
	ctx context.Context
	lim *Limiter
	key CallOption
}

// fill takes calls until the quota refuses one, which must name a wait.
func (r securityRig) fill(what string) {
	t := r.t
	t.Helper()
	for {
		d, err := r.lim.Allow(r.ctx, r.key)
		if err != nil {
			t.Fatalf("%s: Allow: %v", what, err)
		}
		if !d.OK {
			if d.RetryAfter <= 0 {
				t.Fatalf("%s: Allow refused with RetryAfter %v, want > 0", what, d.RetryAfter)
			}
			return
		}
	}
}

// usage is l.Usage that fails the test on an error.
func (r securityRig) usage(what string, l *Limiter, opts ...CallOption) Usage {
	t := r.t
	t.Helper()
	u, err := l.Usage(r.ctx, opts...)
	if err != nil {
		t.Fatalf("%s: Usage: %v", what, err)
	}
	return u
}

// waitsAndGivesUp fills the window, waits for a slot in Block mode, and
// gives up a waiter whose booking must go back.
func (r securityRig) waitsAndGivesUp() {
	t, ctx, lim, key := r.t, r.ctx, r.lim, r.key
	t.Helper()
	for i := range securityLimit {
		if d, err := lim.Allow(ctx, key); err != nil || !d.OK {
			t.Fatalf("Allow %d of %d: %+v, %v; want admitted", i+1, securityLimit, d, err)
		}
	}
	r.fill("a full window")

	p, err := lim.Acquire(ctx, key)
	if err != nil {
		t.Fatalf("Acquire in Block mode: %v", err)
	}
	if p.waited <= 0 {
		t.Errorf("Acquire on a full window waited %v, want it to wait for its slot", p.waited)
	}
	p.Release()

	// A call of the whole limit waits for the window to empty.
	r.fill("before a waiter gives up")
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	waited := make(chan error, 1)
	go func() {
		_, err := lim.Acquire(wctx, key, Cost(securityLimit))
		waited <- err
	}()
	for r.usage("a waiter", lim, key).Rules[0].Booked == 0 {
		select {
		case err := <-waited:
			t.Fatalf("a waiter returned %v before it was given up", err)
		case <-time.After(2 * time.Millisecond):
		}
	}
	stop()
	if err := <-waited; !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire given up while waiting: %v, want context.Canceled", err)
	}
	// The booking goes back as the waiter leaves, or within a Redis round
	// trip after it on a slow machine (see within).
	waitFor(t, func() bool { return r.usage("a waiter gave up", lim, key).Rules[0].Booked == 0 }, "the booking of the waiter that gave up to be given back")
}

// doesSettlesAndIsTold runs Do, settles a permit's cost, reads Usage, and
// tells the quota the vendor's count and a pause.
func (r securityRig) doesSettlesAndIsTold() {
	t, ctx, lim, key := r.t, r.ctx, r.lim, r.key
	t.Helper()
	ran := false
	if _, err := Do(ctx, lim, func(context.Context) (struct{}, error) { ran = true; return struct{}{}, nil }, key); err != nil || !ran {
		t.Fatalf("Do: ran %v, %v", ran, err)
	}

	p, err := lim.Acquire(ctx, key, Cost(2))
	if err != nil {
		t.Fatalf("Acquire of cost 2: %v", err)
	}
	if err := p.Settle(ctx, Cost(1)); err != nil || p.cost() != 1 {
		t.Errorf("Settle to 1: cost %d, %v", p.cost(), err)
	}
	p.Release()

	u := r.usage("the quota", lim, key)
	if len(u.Rules) != 4 || u.Rules[0].Used == 0 {
		t.Errorf("Usage: %+v, want 4 rules and units used in the log", u)
	}

	if err := lim.SetRemaining(ctx, 0, securityWindow, key); err != nil {
		t.Fatalf("SetRemaining: %v", err)
	}
	if n := r.usage("the vendor has none left", lim, key).Remaining; n != 0 {
		t.Errorf("%d units remaining after the vendor said none are, want 0", n)
	}
	if err := lim.Pause(ctx, securityWindow, key); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if paused := r.usage("paused", lim, key).Paused; paused <= 0 {
		t.Errorf("Usage.Paused = %v after Pause, want > 0", paused)
	}
}

// holdsAConcurrencySlot takes, extends and releases a Concurrency slot.
func (r securityRig) holdsAConcurrencySlot(rdb redis.UniversalClient) {
	t, ctx := r.t, r.ctx
	t.Helper()
	conc, err := New(rdb, "security-concurrency", policies.Concurrency{Max: 1, Lease: 10 * time.Second}, Options{Mode: FailFast})
	if err != nil {
		t.Fatal(err)
	}
	p, err := conc.Acquire(ctx)
	if err != nil {
		t.Fatalf("Concurrency: Acquire: %v", err)
	}
	if _, err := conc.Acquire(ctx); !errors.Is(err, ErrLimited) {
		t.Errorf("Concurrency: a second Acquire while the slot is held: %v, want ErrLimited", err)
	}
	if err := p.Extend(ctx, 5*time.Second); err != nil {
		t.Errorf("Concurrency: Extend: %v", err)
	}
	p.Release()
	if used := r.usage("slot released", conc).Rules[0].Used; used != 0 {
		t.Errorf("Concurrency: %d slots in use after Release, want 0", used)
	}
	if p, err = conc.Acquire(ctx); err != nil {
		t.Errorf("Concurrency: Acquire after Release: %v", err)
	} else {
		p.Release()
	}
}

// callsThroughTheTransport makes a call through the Transport to a vendor
// that reports its remaining count, which the quota must take in.
func (r securityRig) callsThroughTheTransport(rdb redis.UniversalClient) {
	t, ctx := r.t, r.ctx
	t.Helper()
	var arrivals atomic.Int64
	vendor := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrivals.Add(1)
		w.Header().Set("X-RateLimit-Remaining", "5")
		_, _ = io.WriteString(w, "ok")
	}))
	defer vendor.Close()
	hl, err := New(rdb, "security-http", policies.SlidingLog{Limit: 10, Window: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	base := &http.Transport{}
	defer base.CloseIdleConnections()
	client := &http.Client{Transport: &Transport{Base: base, Limiter: hl}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, vendor.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("a call through the Transport: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK || string(body) != "ok" || arrivals.Load() != 1 {
		t.Errorf("a call through the Transport: %d %q, %v; %d arrivals at the vendor, want 200 \"ok\" and 1",
			resp.StatusCode, body, err, arrivals.Load())
	}
	// The vendor says 5 of 10 are left after the one call: the quota
	// leaves the others the 4 it did not know of, and a unit more.
	if u := r.usage("after the Transport", hl).Rules[0]; u.Remaining != leftAfter(10, 1, 5) {
		t.Errorf("the Transport's quota has %d left after the vendor said 5 of 10 are left, want %d", u.Remaining, leftAfter(10, 1, 5))
	}
}

// Every path works over TLS, with a client that trusts the server's CA.
func TestSecurity_TLS(t *testing.T) {
	s := redistest.StartTLS(t)
	securityPaths(t, s.Client(t))
}

// aclPassword is the password of the test's ACL users.
const aclPassword = "a-password-for-the-test"

// aclRules are the rights of throttle's ACL user, as the README lists them:
// the quotas' keys; EVALSHA, and EVAL for when Redis does not know a script
// yet; and every command the scripts call, for Redis checks each one
// against the user running the script.
var aclRules = []string{
	"~throttle:*", "resetchannels", "&throttle:*", "-@all",
	"+evalsha", "+eval", "+publish", "+subscribe", "+unsubscribe", "+ping",
	"+time", "+get", "+set", "+del", "+pttl", "+pexpire",
	"+hgetall", "+hmget", "+hset", "+hincrby", "+hdel",
	"+zadd", "+zrem", "+zcard", "+zcount", "+zrange", "+zrangebyscore", "+zremrangebyscore",
}

// without returns the README's rights (aclRules) without drop, and with
// add when not empty.
func without(drop, add string) []string {
	rules := slices.DeleteFunc(slices.Clone(aclRules), func(r string) bool { return r == drop })
	if add != "" {
		rules = append(rules, add)
	}
	return rules
}

// aclSetInfo is the right to run CLIENT SETINFO, which go-redis sends on
// each new connection. It ignores a refusal, but Redis writes one to ACL
// LOG for every connection. Redis before 7.2 has no such subcommand: it
// answers ERR unknown subcommand, and ACL SETUSER refuses the rule.
const aclSetInfo = "+client|setinfo"

// redisAtLeast reports whether the server's version is major.minor or later.
func redisAtLeast(t *testing.T, admin *redis.Client, major, minor int) bool {
	t.Helper()
	raw, err := admin.Info(context.Background(), "server").Result()
	if err != nil {
		t.Fatalf("INFO server: %v", err)
	}
	for l := range strings.Lines(raw) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "redis_version:"); ok {
			ma, rest, _ := strings.Cut(v, ".")
			mi, _, _ := strings.Cut(rest, ".")
			a, _ := strconv.Atoi(ma)
			b, _ := strconv.Atoi(mi)
			return a > major || a == major && b >= minor
		}
	}
	t.Fatalf("INFO server has no redis_version:\n%s", raw)
	return false
}

// aclUser creates (or replaces) the ACL user name with rules, and the right
// to CLIENT SETINFO where Redis has it, and returns a client that logs in
// as it.
func aclUser(t *testing.T, s *redistest.Server, admin *redis.Client, name string, rules []string) *redis.Client {
	t.Helper()
	args := append([]string{"reset", "on", ">" + aclPassword}, rules...)
	if redisAtLeast(t, admin, 7, 2) {
		args = append(args, aclSetInfo)
	}
	if err := admin.ACLSetUser(context.Background(), name, args...).Err(); err != nil {
		t.Fatalf("ACL SETUSER %s %s: %v", name, strings.Join(args, " "), err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.Addr, Username: name, Password: aclPassword, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// aclDenials returns what ACL LOG holds, one refusal a line: its reason,
// object, context, user and count.
func aclDenials(t *testing.T, admin *redis.Client) []string {
	t.Helper()
	log, err := admin.ACLLog(context.Background(), 100).Result()
	if err != nil {
		t.Fatalf("ACL LOG: %v", err)
	}
	var out []string
	for _, e := range log {
		out = append(out, e.Reason+" "+e.Object+" ("+e.Context+", user "+e.Username+", "+strconv.FormatInt(e.Count, 10)+"x)")
	}
	return out
}

// commandsRun returns the commands that INFO commandstats counts, with the
// calls Redis rejected.
func commandsRun(t *testing.T, admin *redis.Client) map[string]string {
	t.Helper()
	raw, err := admin.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatalf("INFO commandstats: %v", err)
	}
	run := map[string]string{}
	for l := range strings.Lines(raw) {
		// cmdstat_zadd:calls=12,usec=40,usec_per_call=3.33,rejected_calls=0,failed_calls=0
		name, stats, ok := strings.Cut(strings.TrimSpace(l), ":")
		if name, found := strings.CutPrefix(name, "cmdstat_"); ok && found {
			run[name] = stats
		}
	}
	return run
}

// A user with only the rights of aclRules runs every path, and Redis
// refuses it nothing: ACL LOG stays empty. Every command the scripts ran is
// one that aclRules grants.
func TestSecurity_ACLUserWithOnlyWhatTheReadmeLists(t *testing.T) {
	t.Parallel()
	s := redistest.Real(t)
	admin := adminClient(t, s.Addr)
	ctx := context.Background()
	rdb := aclUser(t, s, admin, "throttle", aclRules)
	if err := admin.ACLLogReset(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	securityPaths(t, rdb)

	if denied := aclDenials(t, admin); len(denied) > 0 {
		t.Errorf("Redis refused the user %d times: %q", len(denied), denied)
	}
	run := commandsRun(t, admin)
	var names []string
	for name, stats := range run {
		switch name {
		case "config|resetstat", "acl|log", "info":
			continue // the test's own, as the default user
		case "hello", "auth":
			// go-redis logs in with HELLO AUTH; Redis lets anyone run HELLO
			// and AUTH, whatever their rights, so that they can log in.
			continue
		}
		names = append(names, name)
		if !slices.Contains(aclRules, "+"+name) && "+"+name != aclSetInfo {
			t.Errorf("Redis ran %s (%s), which aclRules does not grant", name, stats)
		}
	}
	slices.Sort(names)
	t.Logf("commands run as the user, the scripts' included: %s", strings.Join(names, " "))
}

// A user missing one right gets ErrUnavailable, with Redis's words for the
// refusal, and ACL LOG names what is missing.
func TestSecurity_ACLUserMissingARight(t *testing.T) {
	for _, c := range []struct {
		name  string
		rules []string
		// what the error must say, on every Redis version
		want []string
		// what ACL LOG must hold: reason and object
		reason, object string
		// whether the refused command is one a script calls
		inScript bool
	}{
		{"WithoutEvalsha", without("+evalsha", ""), []string{"NOPERM", "evalsha"}, "command", "evalsha", false},
		// Redis refuses a command inside a script with an ERR that names
		// the command only from Redis 7.2 on: see below.
		{"WithoutZadd", without("+zadd", ""), []string{"script"}, "command", "zadd", true},
		{"WithoutTheKeys", without("~throttle:*", "~other:*"), []string{"NOPERM", "key"}, "key", "throttle:{security-acl}:", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := redistest.Real(t)
			admin := adminClient(t, s.Addr)
			rdb := aclUser(t, s, admin, "throttle", c.rules)
			lim, err := New(rdb, "security-acl", policies.SlidingLog{Limit: 10, Window: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			_, err = lim.Allow(context.Background())
			t.Logf("Allow: %v", err)
			if !errors.Is(err, ErrUnavailable) {
				t.Errorf("Allow: %v, want ErrUnavailable", err)
			}
			for _, w := range c.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("Allow: %v, want it to say %q", err, w)
				}
			}
			denied := aclDenials(t, admin)
			if !slices.ContainsFunc(denied, func(d string) bool { return strings.HasPrefix(d, c.reason+" "+c.object) }) {
				t.Errorf("ACL LOG holds %q, want a refusal of %s %s", denied, c.reason, c.object)
			}
			if !c.inScript {
				return
			}
			// Redis 7.0 refuses a command inside a script with "ERR The
			// user executing the script can't run this command or
			// subcommand script: <sha>, on @user_script:<line>."; the error
			// names the command that line calls.
			if err == nil || !strings.Contains(strings.ToLower(err.Error()), c.object) {
				t.Errorf("Allow: %v, want it to name %q", err, c.object)
			}
		})
	}
}

// A missing right is no outage: no OnRedisError turns it into no limit at
// all, or a limit of the process's own; the call fails with Redis's
// refusal, naming the right to grant. A command the scripts call, the
// quota's key pattern, and its channel, which a pause publishes on.
//
// Recognising a refusal by Redis 7.0's words alone let FailOpen through
// with no limit on Redis 7.2, 7.4, 8.0 and Valkey 8, whose words differ.
func TestSecurity_MissingRightIsNotAnOutage(t *testing.T) {
	s := redistest.Real(t)
	admin := adminClient(t, s.Addr)
	for _, right := range []struct {
		name  string
		rules []string
		want  string // in the error
		pause bool   // the refusal shows on a pause, which publishes
	}{
		{"Command", without("+zadd", ""), "+zadd", false},
		{"Keys", without("~throttle:*", "~other:*"), "~throttle:*", false},
		{"Channel", without("&throttle:*", "&other:*"), "&throttle:*", true},
	} {
		for _, o := range []OnRedisError{FailClosed, FailOpen, Local} {
			t.Run(right.name+"/"+string(o), func(t *testing.T) {
				rdb := aclUser(t, s, admin, "throttle", right.rules)
				lim, err := New(rdb, "security-"+right.name+"-"+string(o), policies.SlidingLog{Limit: 10, Window: time.Second},
					Options{OnRedisError: o, ExpectedReplicas: 2, Logger: quiet()})
				if err != nil {
					t.Fatal(err)
				}
				ctx := context.Background()
				for i := range 5 { // past the breaker's three failures
					if right.pause {
						err = lim.Pause(ctx, time.Second)
					} else {
						var d Decision
						if d, err = lim.Allow(ctx); err == nil && d.OK {
							t.Fatalf("call %d admitted; want Redis's refusal, not a call let through", i+1)
						}
					}
					if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), right.want) {
						t.Fatalf("call %d: %v, want ErrUnavailable naming %s", i+1, err, right.want)
					}
				}
				t.Logf("%v", err)
				if lim.failover.brk.allow().probe {
					t.Error("the breaker opened on a refusal")
				}
			})
		}
	}
}

// The refusals of every engine's words are refusals, with the right they
// lack named; the replies of a server passing through a state it leaves by
// itself, and failures to reach it, are outages.
func TestSecurity_RefusalsInEachEnginesWords(t *testing.T) {
	for _, c := range []struct {
		engine, reply string
		right         string // named in the error; "" for no ACL refusal
	}{
		{"Redis 7.0", "NOPERM this user has no permissions to run the 'evalsha' command or its subcommand", "+evalsha"},
		{"Redis 7.0", "NOPERM this user has no permissions to access one of the keys used as arguments", "~throttle:*"},
		{"Redis 7.0", "NOPERM this user has no permissions to access one of the channels used as arguments", "&throttle:*"},
		{"Redis 7.0", "ERR The user executing the script can't run this command or subcommand script: 0123abcd, on @user_script:1.", "see ACL LOG"},
		{"Redis 7.0", "ERR The user executing the script can't access at least one of the keys mentioned in the command script: 0123abcd, on @user_script:1.", "~throttle:*"},
		{"Redis 7.0", "ERR The user executing the script can't publish to the channel mentioned in the command script: 0123abcd, on @user_script:1.", "&throttle:*"},
		{"Redis 7.2, 7.4, 8.0, Valkey 8", "NOPERM User throttle has no permissions to run the 'evalsha' command", "+evalsha"},
		{"Redis 7.2, 7.4, 8.0, Valkey 8", "NOPERM No permissions to access a key", "~throttle:*"},
		{"Redis 7.2, 7.4, 8.0, Valkey 8", "NOPERM No permissions to access a channel", "&throttle:*"},
		{"Redis 7.2, 7.4, 8.0, Valkey 8", "ERR ACL failure in script: User throttle has no permissions to run the 'zadd' command script: 0123abcd, on @user_script:1.", "+zadd"},
		{"Redis 7.2, 7.4, 8.0, Valkey 8", "ERR ACL failure in script: No permissions to access a key script: 0123abcd, on @user_script:1.", "~throttle:*"},
		{"Redis 7.2, 7.4, 8.0, Valkey 8", "ERR ACL failure in script: No permissions to access a channel script: 0123abcd, on @user_script:1.", "&throttle:*"},
		{"Redis 6", "ERR Error running script (call to f_0123abcd): @user_script:1: @user_script: 1: The user executing the script can't run this command or subcommand", "see ACL LOG"},
		{"any", "NOAUTH Authentication required.", ""},
		{"any", "WRONGPASS invalid username-password pair or user is disabled.", ""},
		{"any", "WRONGTYPE Operation against a key holding the wrong kind of value script: 0123abcd, on @user_script:1.", ""},
		{"scripting turned off", "ERR unknown command 'evalsha', with args beginning with: ", ""},
		{"Dragonfly", "ERR script tried accessing undeclared key", ""},
	} {
		err := &unavailableError{Quota: "q", Err: replyError(c.reply), prefix: "throttle"}
		if !refusedByConfiguration(err) {
			t.Errorf("%s: %q taken for an outage", c.engine, c.reply)
		}
		if c.right != "" && !strings.Contains(err.Error(), c.right) {
			t.Errorf("%s: %q gives %q, which does not name %s", c.engine, c.reply, err.Error(), c.right)
		}
	}
	for _, outage := range []error{
		replyError("LOADING Redis is loading the dataset in memory"),
		replyError("READONLY You can't write against a read only replica. script: 0123abcd, on @user_script:1."),
		replyError("ERR Error running script (call to f_0123abcd): @user_script:1: -READONLY You can't write against a read only replica."),
		replyError("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
		replyError("CLUSTERDOWN The cluster is down"),
		replyError("TRYAGAIN Multiple keys request during rehashing of slot"),
		replyError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."),
		replyError("OOM command not allowed when used memory > 'maxmemory'. script: 0123abcd, on @user_script:1."),
		replyError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk."),
		replyError("ERR max number of clients reached"),
		replyError("NOREPLICAS Not enough good replicas to write."),
		replyError("no upstream host"),
		&net.OpError{Op: "dial", Err: errors.New("connect: connection refused")},
		context.DeadlineExceeded,
		redis.ErrClosed,
	} {
		if refusedByConfiguration(outage) {
			t.Errorf("%q taken for a refusal, not an outage", outage)
		}
	}
}

// replyError is an error reply of Redis, as go-redis returns it.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

// aclToolRules are the rights docs/REDIS.md adds for the tools that read
// quotas without their policy: Quotas, Open, BusiestKeys, the dashboard.
var aclToolRules = []string{"+scan", "+hget"}

// The tools read every quota with the rights docs/REDIS.md lists for them,
// and nothing more.
func TestSecurity_ToolsNeedOnlyWhatTheDocsList(t *testing.T) {
	s := redistest.Real(t)
	admin := adminClient(t, s.Addr)
	ctx := context.Background()
	setup, err := New(admin, "tools", policies.All(
		policies.SlidingLog{Limit: 10, Window: time.Second},
		policies.PerKey{Policy: policies.SlidingLog{Limit: 5, Window: time.Second}}))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := setup.Allow(ctx, Key("a")); err != nil {
		t.Fatal(err)
	}
	rdb := aclUser(t, s, admin, "tools", append(slices.Clone(aclRules), aclToolRules...))
	if err := admin.ACLLogReset(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	names, err := Quotas(ctx, rdb, "")
	if err != nil || len(names) != 1 {
		t.Fatalf("Quotas: %v, %v", names, err)
	}
	lim, err := Open(ctx, rdb, names[0])
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if _, err := lim.Usage(ctx, Key("")); err != nil {
		t.Errorf("Usage: %v", err)
	}
	if keys, err := lim.BusiestKeys(ctx, 3); err != nil || len(keys) != 1 {
		t.Errorf("BusiestKeys: %v, %v", keys, err)
	}
	if denied := aclDenials(t, admin); len(denied) > 0 {
		t.Errorf("Redis refused the tools %d times: %q", len(denied), denied)
	}
}
