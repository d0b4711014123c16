package throttle

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"
	"weak"

	"github.com/redis/go-redis/v9"
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

// hub is the subscription of one client, shared by its limiters. It holds
// them weakly: a limiter dropped without Close is forgotten, not kept.
type hub struct {
	mu   sync.Mutex
	ps   *redis.PubSub
	subs map[string][]weak.Pointer[Limiter] // channel -> limiters
}

var hubs sync.Map // redis.UniversalClient -> *hub

// listen subscribes l to its quota's news, once, without waiting for Redis.
func (l *Limiter) listen() {
	l.listening.Do(func() {
		v, _ := hubs.LoadOrStore(l.rdb, &hub{subs: map[string][]weak.Pointer[Limiter]{}})
		h := v.(*hub)
		h.mu.Lock()
		defer h.mu.Unlock()
		channel := l.shared[0]
		h.subs[channel] = append(live(h.subs[channel], nil), weak.Make(l))
		if h.ps == nil {
			h.ps = l.rdb.Subscribe(context.Background(), channel)
			go h.serve(h.ps.Channel())
		} else if len(h.subs[channel]) == 1 {
			// go-redis sends SUBSCRIBE again by itself after a reconnect.
			go func(ps *redis.PubSub) { _ = ps.Subscribe(context.Background(), channel) }(h.ps)
		}
	})
}

// unlisten ends l's subscription; the last limiter of a client closes it.
func (l *Limiter) unlisten() {
	v, ok := hubs.Load(l.rdb)
	if !ok {
		return
	}
	h := v.(*hub)
	h.mu.Lock()
	defer h.mu.Unlock()
	channel := l.shared[0]
	subs := live(h.subs[channel], l)
	if len(subs) > 0 {
		h.subs[channel] = subs
		return
	}
	delete(h.subs, channel)
	if len(h.subs) > 0 {
		go func(ps *redis.PubSub) { _ = ps.Unsubscribe(context.Background(), channel) }(h.ps)
		return
	}
	if h.ps != nil {
		_ = h.ps.Close()
		h.ps = nil
	}
	hubs.CompareAndDelete(l.rdb, h)
}

func (h *hub) serve(ch <-chan *redis.Message) {
	for msg := range ch {
		h.mu.Lock()
		subs := live(h.subs[msg.Channel], nil)
		h.subs[msg.Channel] = subs
		h.mu.Unlock()
		for _, p := range subs {
			if l := p.Value(); l != nil {
				l.news(msg.Payload)
			}
		}
	}
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

// news applies a message of the quota's channel.
func (l *Limiter) news(payload string) {
	f := strings.Fields(payload)
	if len(f) != 4 {
		return
	}
	a, err1 := strconv.ParseInt(f[2], 10, 64)
	now, err2 := strconv.ParseInt(f[3], 10, 64)
	if err1 != nil || err2 != nil {
		return
	}
	us := func(x int64) time.Duration { return time.Duration(x) * time.Microsecond }
	switch f[0] {
	case "q":
		epoch, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return
		}
		if l.epoch.Load() != 0 {
			l.noteEpoch(epoch, false)
		}
		l.notePause(scope{keys: []string{l.shared[0], l.shared[0]}}, us(now), us(a))
	case "k":
		l.notePause(scope{keys: []string{l.shared[0], f[1]}}, us(now), us(a))
	}
}
