package vendors

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"time"
)

// twilioFake answers POST /2010-04-01/Accounts/{sid}/Messages.json as
// Twilio documents its API's limit (docs/VENDORS.md has the source): the
// account's requests in flight, past which a request gets a 429 with the
// code 20429 and is not processed.
type twilioFake struct {
	inFlight int
	latency  time.Duration
	start    time.Time
	refuse   int // the first requests refused whatever the count

	mu        sync.Mutex
	flying    int
	most      int
	processed []int // per second of the run
	refused   int   // after the first second
	early     int
}

func newTwilioFake(inFlight int, latency time.Duration) *twilioFake {
	return &twilioFake{inFlight: inFlight, latency: latency, start: time.Now()}
}

func (v *twilioFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil || r.PostForm.Get("To") == "" {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	now := time.Now()
	v.mu.Lock()
	v.flying++
	v.most = max(v.most, v.flying)
	over := v.flying > v.inFlight || v.refuse > 0
	if over {
		v.refuse = max(v.refuse-1, 0)
		v.flying--
		if now.Sub(v.start) < time.Second {
			v.early++
		} else {
			v.refused++
		}
		flying := v.flying
		v.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Twilio-Concurrent-Requests", strconv.Itoa(flying))
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"code":20429,"message":"Too Many Requests","more_info":"https://www.twilio.com/docs/errors/20429","status":429}`)
		return
	}
	v.mu.Unlock()
	time.Sleep(v.latency)
	v.mu.Lock()
	k := int(time.Since(v.start) / time.Second)
	for len(v.processed) <= k {
		v.processed = append(v.processed, 0)
	}
	v.processed[k]++
	v.flying-- // done before the answer leaves: a client may send again once it has it
	v.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"sid":"SM1","status":"queued","to":%q}`, r.PostForm.Get("To"))
}

func (v *twilioFake) results() (refused, early, most int, processed []int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.refused, v.early, v.most, append([]int(nil), v.processed...)
}

func (v *twilioFake) serve() *httptest.Server { return httptest.NewServer(v) }
