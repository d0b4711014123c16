package dashboard_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/throttlekit/throttle"
	"github.com/throttlekit/throttle/dashboard"
	"github.com/throttlekit/throttle/policies"
)

// Mount the dashboard on an admin mux, under a path of its own. Here a
// miniredis stands for the fleet's Redis, and one call of the fleet's
// shows on the page; the example reads the page's data as JSON.
func Example() {
	mr, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	// A process of the fleet makes a call.
	lim, err := throttle.New(rdb, "sms", policies.SlidingLog{Limit: 100, Window: time.Minute})
	if err != nil {
		panic(err)
	}
	if _, err := lim.Allow(context.Background()); err != nil {
		panic(err)
	}

	admin := http.NewServeMux()
	admin.Handle("/throttle/", http.StripPrefix("/throttle", dashboard.New(rdb, dashboard.Options{})))
	srv := httptest.NewServer(admin) // in production: http.ListenAndServe("localhost:8081", admin)
	defer srv.Close()

	res, err := http.Get(srv.URL + "/throttle/?format=json")
	if err != nil {
		panic(err)
	}
	defer res.Body.Close()
	var page struct {
		Quotas []struct {
			Name  string
			Rules []struct {
				Kind        string
				Used, Limit int
			}
		}
	}
	if err := json.NewDecoder(res.Body).Decode(&page); err != nil {
		panic(err)
	}
	for _, q := range page.Quotas {
		r := q.Rules[0]
		fmt.Printf("%s: %s, %d used of %d\n", q.Name, r.Kind, r.Used, r.Limit)
	}
	// Output: sms: sliding log, 1 used of 100
}
