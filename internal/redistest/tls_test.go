//go:build unix

package redistest

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// A client that trusts the test CA talks to the server over TLS; one that
// does not, or one that speaks plain RESP, gets nothing from it.
func TestStartTLS(t *testing.T) {
	t.Parallel()
	s := StartTLS(t)
	ctx := ctxT(t)
	if p := portOf(t, s.Addr); p == reservedPort || !strings.HasPrefix(s.Addr, "127.0.0.1:") {
		t.Fatalf("Addr %q: want 127.0.0.1 and a port other than %d", s.Addr, reservedPort)
	}
	c := s.Client(t)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET over TLS: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET over TLS = %q, %v", got, err)
	}
	if port, err := c.ConfigGet(ctx, "port").Result(); err != nil || port["port"] != "0" {
		t.Errorf("CONFIG GET port = %v, %v; want 0: the server must not listen in plain text", port, err)
	}

	// The system's roots do not know the test CA.
	untrusting := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1,
		TLSConfig: &tls.Config{ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}})
	defer untrusting.Close()
	var unknown x509.UnknownAuthorityError
	if err := untrusting.Ping(ctx).Err(); !errors.As(err, &unknown) {
		t.Errorf("PING with a client that does not trust the test CA: %v, want an unknown authority error", err)
	}
	// The certificate is for 127.0.0.1, not for another name.
	cfg := s.TLSConfig()
	cfg.ServerName = "redis.example"
	misnamed := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, TLSConfig: cfg})
	defer misnamed.Close()
	if err := misnamed.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("PING expecting another server name: %v, want a certificate error", err)
	}
	plain := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
	defer plain.Close()
	if err := plain.Ping(ctx).Err(); err == nil {
		t.Error("PING in plain text succeeded on the TLS port")
	}
}

func TestTLSUnsupported_ReadsTheLog(t *testing.T) {
	for _, c := range []struct {
		log  string
		want bool
	}{
		{"*** FATAL CONFIG FILE ERROR (Redis 6.2.6) ***\nReading the configuration file, at line 2\n>>> 'tls-port \"6380\"'\nBad directive or wrong number of arguments", true},
		{"# Failed finding connection listener of tls", true},
		{"# Failed finding TLS support.", true},
		{"*** FATAL CONFIG FILE ERROR ***\n>>> 'port \"x\"'\nBad directive or wrong number of arguments", false},
		{"# Could not create server TCP listening socket 127.0.0.1:6380: bind: Address already in use", false},
	} {
		if got := tlsUnsupported(c.log); got != c.want {
			t.Errorf("tlsUnsupported(%q) = %v, want %v", c.log, got, c.want)
		}
	}
}
