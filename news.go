package throttle

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle/internal/protocol"
)

// What one replica learns of a quota must reach the others before their
// sleeping calls wake: a vendor's pause, a loss of the quota's data. A
// process that sleeps towards a booked slot may make no call to Redis in
// between, so the scripts that learn such news publish it, on a channel
// named as the quota's meta key, and every process listens. One
// subscription serves every limiter of a process on one client.
//
// The messages:
//
//	q <epoch> <pause until> <now>    the quota's epoch and pause, after a loss or a pause
//	k <pause key> <until> <now>      the pause of one key of a quota
//	f <epoch> <until> <now> [<ids>]  units given back left room until then, for the limiters named (move.go)
//	l <epoch> <at> <now>             a limit in force dropped at: calls decided before book again (view.go)
//
// A quota of a group (policies.Shared) listens to the group's channel too,
// named as the group's key: the l and f of a shared rule go there, told by
// any quota of the group, whatever its epoch (see Groups in lua/lib.lua).

// A process that cannot hear the news cannot trust its bookings: while the
// subscription is cut, a pause or a loss may be published unheard, and a
// Redis that failed decides nothing while the replicas that noticed it
// decide without it (the Local fallback). So the subscription watches its
// own connection: an error counts as a gap, and so does a ping unanswered
// while no news comes and calls of the process sleep towards their slots
// (a process with none has no booking to protect, and sends no ping). Each
// limiter counts the gaps it was told of (Limiter.gaps), and a call that
// wakes towards a slot booked before a gap asks Redis again (see
// overtaken). A process notices a gap within noticeWithin of the failure
// that caused it.
//
// newsPing is how long an idle subscription waits before it pings Redis.
// The answer may take as long as a script call may (Options.RedisTimeout):
// a slow Redis is no gap.
const newsPing = 100 * time.Millisecond

// noticeWithin bounds how long after Redis stops answering a process of
// the fleet notices it: an idle read, an unanswered ping, and the time to
// run the loop, as the limiters of this quota are configured.
func (l *Limiter) noticeWithin() time.Duration { return 2*newsPing + l.s.redisTimeout }

// hub is the subscription of one client, shared by its limiters. It holds
// them weakly: a limiter dropped without Close is forgotten, not kept.
//
// One goroutine, serve, does all the hub's talking to Redis: it reads, it
// pings, and it subscribes and unsubscribes the channels that listen and
// unlisten ask for. A call that meets a new limiter never waits for a
// connection of the subscription, nor for a lock held across one (go-redis
// holds the PubSub's while it dials).
type hub struct {
	mu      sync.Mutex
	ps      *redis.PubSub
	subs    map[string][]weak.Pointer[Limiter] // channel -> limiters
	join    []string                           // channels to subscribe to, for serve
	leave   []string                           // channels to unsubscribe from, for serve
	closing bool                               // the last limiter left: serve closes ps and returns
	done    chan struct{}                      // closed when serve has returned
}

var hubs sync.Map // redis.UniversalClient -> *hub

// listen subscribes l to its quota's news, once, without waiting for Redis.
func (l *Limiter) listen() {
	if isOff(offNews) {
		return
	}
	l.view.listening.Do(func() {
		for {
			v, _ := hubs.LoadOrStore(l.rdb, &hub{subs: map[string][]weak.Pointer[Limiter]{}})
			if v.(*hub).add(l) {
				return
			}
			hubs.CompareAndDelete(l.rdb, v) // a hub closing: make another
		}
	})
}

// add adds l to the hub, and reports false when the hub is closing.
func (h *hub) add(l *Limiter) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closing {
		return false
	}
	for _, channel := range l.channels() {
		h.subs[channel] = append(live(h.subs[channel], nil), weak.Make(l))
		if len(h.subs[channel]) == 1 {
			h.join = append(h.join, channel)
			h.leave = slices.DeleteFunc(h.leave, func(c string) bool { return c == channel })
		}
	}
	if h.ps == nil {
		// No channel yet: go-redis makes the PubSub without a connection.
		h.ps = l.rdb.Subscribe(context.Background())
		h.done = make(chan struct{})
		go h.serve(h.ps)
	}
	return true
}

// unlisten ends l's subscription; the last limiter of a client closes it,
// and gets a channel that closes once the subscription's goroutine has
// returned (nil otherwise).
func (l *Limiter) unlisten() <-chan struct{} {
	v, ok := hubs.Load(l.rdb)
	if !ok {
		return nil
	}
	h := v.(*hub)
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, channel := range l.channels() {
		if subs := live(h.subs[channel], l); len(subs) > 0 {
			h.subs[channel] = subs
			continue
		}
		delete(h.subs, channel)
		h.join = slices.DeleteFunc(h.join, func(c string) bool { return c == channel })
		h.leave = append(h.leave, channel)
	}
	if len(h.subs) == 0 && !h.closing {
		h.closing = true
		hubs.CompareAndDelete(l.rdb, h)
		// serve sees it after its read, newsPing at most: closing the
		// PubSub here would wait for the read's lock anyway.
		return h.done
	}
	return nil
}

// channels returns the channels l listens to: its quota's, named as its
// meta key, and its group's, if any.
func (l *Limiter) channels() []string {
	if l.cfg.groupKey == "" {
		return l.cfg.shared[:1]
	}
	return []string{l.cfg.shared[0], l.cfg.groupKey}
}

// chores takes what listen and unlisten asked of serve.
func (h *hub) chores() (join, leave []string, closing bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	join, leave = h.join, h.leave
	h.join, h.leave = nil, nil
	return join, leave, h.closing
}

// serve reads the subscription until the hub closes: it hands each message
// to the limiters of its channel, and tells them of each gap. A read that
// finds nothing for newsPing sends a ping; a second one finds the ping
// unanswered, which is a gap, as is an error. The cut lasts until a ping
// sent on a new connection is answered. Between reads it subscribes and
// unsubscribes what listen and unlisten asked for.
func (h *hub) serve(ps *redis.PubSub) {
	defer close(h.done)
	defer ps.Close()
	var cut, pinged bool // the connection is cut; a ping is unanswered
	for {
		if !h.doChores(ps) {
			return
		}
		wait := newsPing
		if pinged {
			wait = h.pongWithin()
		}
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		msg, err := ps.ReceiveTimeout(ctx, wait)
		cancel()
		if errors.Is(err, redis.ErrClosed) {
			return // the client was closed
		}
		if err == nil {
			pinged = false
			if cut {
				cut = false
				h.gap() // what was published while it was cut went unheard
			}
			if m, ok := msg.(*redis.Message); ok {
				h.deliver(m)
			}
			continue
		}
		if isTimeout(err) && !pinged && !cut {
			if !h.asleep() {
				continue
			}
			// Idle while calls sleep on their bookings: check that the
			// connection still reaches Redis.
			if pinged = ping(ps, h.pongWithin()); !pinged {
				cut = true
				h.gap()
			}
			continue
		}
		if !cut {
			cut = true
			h.gap()
		}
		// go-redis dials again, and subscribes again, when the ping is
		// sent: not in a busy loop.
		time.Sleep(newsPing)
		pinged = ping(ps, h.pongWithin())
	}
}

// doChores subscribes and unsubscribes what listen and unlisten asked for,
// and reports false when the hub closes.
func (h *hub) doChores(ps *redis.PubSub) bool {
	join, leave, closing := h.chores()
	if closing {
		return false
	}
	if len(join) == 0 && len(leave) == 0 {
		return true
	}
	// go-redis keeps the channels asked for, and subscribes to them again
	// on its next connection, whatever this call says.
	ctx, cancel := context.WithTimeout(context.Background(), h.pongWithin())
	defer cancel()
	if len(join) > 0 {
		_ = ps.Subscribe(ctx, join...)
	}
	if len(leave) > 0 {
		_ = ps.Unsubscribe(ctx, leave...)
	}
	return true
}

// ping sends a ping on the subscription, whose answer its next read
// receives, and reports whether it was sent within the time given: on a
// new connection, after its handshake and its subscriptions, which take
// round trips of their own (a Redis 25 ms away needs more than 100 ms).
func ping(ps *redis.PubSub, within time.Duration) bool {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	return ps.Ping(ctx) == nil
}

// deliver hands a message to the limiters of its channel.
func (h *hub) deliver(msg *redis.Message) {
	h.mu.Lock()
	subs := live(h.subs[msg.Channel], nil)
	h.subs[msg.Channel] = subs
	h.mu.Unlock()
	for _, p := range subs {
		if l := p.Value(); l != nil {
			l.news(msg.Channel, msg.Payload)
		}
	}
}

// pongWithin is how long a ping may take to be answered: the longest Redis
// timeout of the hub's limiters.
func (h *hub) pongWithin() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	d := newsPing
	for _, subs := range h.subs {
		for _, p := range subs {
			if l := p.Value(); l != nil {
				d = max(d, l.s.redisTimeout)
			}
		}
	}
	return d
}

// asleep reports whether a call of the hub's limiters sleeps towards a
// slot booked in Redis.
func (h *hub) asleep() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, subs := range h.subs {
		for _, p := range subs {
			if l := p.Value(); l != nil && l.view.asleep.Load() > 0 {
				return true
			}
		}
	}
	return false
}

// named reports whether the news of room names this limiter: its ids,
// when given, list the limiters whose calls are booked first after the
// room (movers in lua/lib.lua).
func (l *Limiter) named(ids []string) bool {
	return len(ids) == 0 || slices.Contains(strings.Split(ids[0], ","), l.id)
}

// gap tells every limiter of the hub that news may have gone unheard.
func (h *hub) gap() {
	h.mu.Lock()
	var all []weak.Pointer[Limiter]
	for _, subs := range h.subs {
		all = append(all, subs...)
	}
	h.mu.Unlock()
	for _, p := range all {
		if l := p.Value(); l != nil {
			l.view.gaps.Add(1)
		}
	}
}

// isTimeout reports whether err is a read that found nothing in time.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout() || errors.Is(err, context.DeadlineExceeded)
}

// live returns the limiters of subs that are still in use, but drop.
func live(subs []weak.Pointer[Limiter], drop *Limiter) []weak.Pointer[Limiter] {
	out := subs[:0:0]
	for _, p := range subs {
		if l := p.Value(); l != nil && l != drop {
			out = append(out, p)
		}
	}
	return out
}

// news applies a message of the quota's channel, or of its group's.
func (l *Limiter) news(channel, payload string) {
	f := strings.Fields(payload)
	if len(f) != 4 && (len(f) != 5 || f[0] != protocol.NewsRoom) {
		return
	}
	// The group's news is of any quota's epoch: it only makes calls ask again.
	ofGroup := l.cfg.groupKey != "" && channel == l.cfg.groupKey
	if ofGroup && f[0] != protocol.NewsLowered && f[0] != protocol.NewsRoom {
		return
	}
	a, err1 := strconv.ParseInt(f[2], 10, 64)
	now, err2 := strconv.ParseInt(f[3], 10, 64)
	if err1 != nil || err2 != nil {
		return
	}
	us := func(x int64) time.Duration { return time.Duration(x) * time.Microsecond }
	switch f[0] {
	case protocol.NewsQuota:
		epoch, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return
		}
		if l.view.epoch.Load() != 0 {
			l.noteEpoch(epoch, false)
		}
		l.notePause(scope{keys: []string{l.cfg.shared[0], l.cfg.shared[0]}}, us(now), us(a))
	case protocol.NewsKey:
		l.notePause(scope{keys: []string{l.cfg.shared[0], f[1]}}, us(now), us(a))
	case protocol.NewsLowered:
		if ofGroup || l.ofEpoch(f[1]) {
			l.noteLowered(us(a))
			// A share may have risen: this process's counts measure the
			// others too, though no reply of its own said so (see tell).
			if !isOff(offLoweredMeasures) {
				l.measureOthers()
			}
		}
	case protocol.NewsRoom:
		if (ofGroup || l.ofEpoch(f[1])) && l.named(f[4:]) {
			l.room.signal(us(now))
		}
	}
}

// ofEpoch reports whether news of epoch s may be about this limiter's
// calls: of its epoch, or of any while it knows none yet (the reply that
// booked its first call is on its way; a move or a new booking of another
// epoch's call keeps nothing, and the call books again).
func (l *Limiter) ofEpoch(s string) bool {
	epoch, err := strconv.ParseInt(s, 10, 64)
	known := l.view.epoch.Load()
	return err == nil && (epoch == known || known == 0)
}
