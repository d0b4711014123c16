// Package throttle keeps a whole fleet of processes under a third-party
// vendor's rate cap.
//
// Vendors such as Stripe, GitHub, Twilio or an LLM API count every call in a
// sliding window and answer 429 when the account goes over. A fleet of
// replicas that each limit themselves either wastes most of the quota or goes
// over it. throttle asks one Lua script in a shared Redis, before each call,
// whether the call fits the vendor's window; every replica that uses the same
// Redis and the same quota name shares one quota.
//
//	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	lim, err := throttle.New(rdb, "twilio-sms",
//		policies.SlidingLog{Limit: 100, Window: time.Second})
//	...
//	msg, err := throttle.Do(ctx, lim, func(ctx context.Context) (*Message, error) {
//		return sms.Send(ctx, to, body)
//	})
//
// When the quota is full, a call waits for its booked slot (Block, the
// default), fails at once with ErrLimited (FailFast), or waits in a bounded
// local queue by priority (Queue). Key and Cost describe a call: who it is
// for, under policies.PerKey limits, and how many units it counts for
// (policies.PerCall limits count each call once: requests beside tokens).
// A cost known only afterwards is admitted at an estimate and settled as
// the vendor counts it: Do's function finds its Permit with PermitFrom, and
// Settle replaces the estimate by the actual cost. Settle only what the
// vendor settles: OpenAI keeps the estimate it counted at arrival, so its
// calls are charged that estimate and never settled; Anthropic replaces
// its output estimate by the tokens used (docs/VENDORS.md, per vendor).
//
// For HTTP, a Transport wraps an http.RoundTripper: every request goes
// through the limiter, and what the vendor answers reaches every replica:
// its remaining counts, in the headers of GitHub, OpenAI, Anthropic,
// Discord, Shopify, Salesforce, Zendesk, Stripe and the IETF draft; its
// pauses; and, from its refusals about its rate, the cap it really allows,
// which the quota learns and then probes back up (see Answer.AboutRate).
//
//	client := &http.Client{Transport: &throttle.Transport{Limiter: lim}}
//
// When Redis fails, a call is refused with ErrUnavailable, made anyway, or
// decided in-process, as Options.OnRedisError says. An Observer sees every
// decision, for metrics.
//
// Redis decides with its own clock, and every key of a quota shares the hash
// tag {name}, so a quota works the same on a single Redis, behind Sentinel,
// and on Redis Cluster.
//
// What reaches the vendor is when a call arrives, not when Redis admitted
// it. A delay every call shares (a Redis 50 ms away) does no harm; the
// spread of that delay does. Each process measures how late its calls start
// after their slots, beyond its usual delay, and the fleet's windows widen
// by a margin that follows that spread (see policies.SlidingLog.Margin); a
// call that would start later than its margin allows books again. What one
// replica learns (a vendor's pause, a loss of the quota's data in Redis)
// reaches the others through a Redis channel before their waiting calls
// wake.
package throttle
