package redistest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TLSServer is a redis-server that speaks TLS only, with a certificate for
// 127.0.0.1 signed by a CA made for the test.
type TLSServer struct {
	// Addr is the server's host:port, where it speaks TLS and nothing else.
	Addr string

	srv   *Server
	roots *x509.CertPool
}

// StartTLS makes a test CA and a server certificate for 127.0.0.1 (ECDSA
// P-256), and starts redis-server with them on a free 127.0.0.1 TLS port
// and no plain port (--port 0 --tls-port), not asking clients for
// certificates, with no persistence and its own temp dir. It waits until
// the server answers over TLS, and kills it at tb.Cleanup. It skips the
// test when redis-server is not on PATH (fails it when CI=true), and when
// this redis-server was built without TLS, whatever CI says.
func StartTLS(tb testing.TB) *TLSServer {
	tb.Helper()
	bin := serverPath(tb)
	srv := &Server{Real: true, bin: bin, dir: tb.TempDir()}
	tb.Cleanup(func() { srv.cleanup(tb) })
	roots, err := writeTestCerts(srv.dir)
	if err != nil {
		tb.Fatalf("redistest: TLS certificates: %v", err)
	}
	s := &TLSServer{srv: srv, roots: roots}
	for attempt := 1; attempt <= startAttempts; attempt++ {
		var port int
		if port, err = freePort(false); err != nil {
			tb.Fatalf("redistest: %v", err)
		}
		if err = s.launch(port); err == nil {
			return s
		}
		if log := tail(srv.logPath(), 30); tlsUnsupported(log) {
			tb.Skipf("redistest: %s was built without TLS support; skipping:\n%s", bin, log)
		}
		if !errors.Is(err, errExited) {
			break
		}
	}
	tb.Fatalf("redistest: TLS server: %v", err)
	return nil
}

// tlsUnsupported reports whether a server's log says that it cannot speak
// TLS, in any engine's words: a build without it refuses the tls-*
// directives, or says it finds no TLS support (Valkey 8, Redis 7.4 and 8
// built without it), and Redis 7.2 and later built with TLS as a module
// that is not loaded find no TLS listener.
func tlsUnsupported(log string) bool {
	return strings.Contains(log, "Bad directive") && strings.Contains(log, "tls-") ||
		strings.Contains(log, "connection listener of tls") ||
		strings.Contains(strings.ToLower(log), "finding tls support")
}

func (s *TLSServer) launch(port int) error {
	srv := s.srv
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	args := []string{
		"--port", "0",
		"--tls-port", strconv.Itoa(port),
		"--tls-cert-file", filepath.Join(srv.dir, "redis.crt"),
		"--tls-key-file", filepath.Join(srv.dir, "redis.key"),
		"--tls-ca-cert-file", filepath.Join(srv.dir, "ca.crt"),
		"--tls-auth-clients", "no",
		"--bind", "127.0.0.1",
		"--dir", srv.dir,
		"--save", "",
		"--appendonly", "no",
		"--daemonize", "no",
	}
	p, err := startProc(srv.bin, args, srv.logPath())
	if err != nil {
		return fmt.Errorf("start %s on %s: %w", srv.bin, addr, err)
	}
	if err := waitReadyTLS(p, addr, s.TLSConfig(), startTimeout); err != nil {
		kerr := p.kill(stopTimeout)
		return fmt.Errorf("%s on %s (TLS): %w%s\n%s", srv.bin, addr, err, errSuffix(kerr), srv.logTail())
	}
	srv.mu.Lock()
	srv.proc, srv.port, srv.Addr = p, port, addr
	srv.mu.Unlock()
	s.Addr = addr
	return nil
}

// TLSConfig returns a new client configuration that trusts the test CA
// alone and checks that the server's certificate is for 127.0.0.1.
func (s *TLSServer) TLSConfig() *tls.Config {
	return &tls.Config{RootCAs: s.roots, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
}

// Client returns a new go-redis client of the server over TLS, with
// ContextTimeoutEnabled, closed at tb.Cleanup.
func (s *TLSServer) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr, TLSConfig: s.TLSConfig(), ContextTimeoutEnabled: true})
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Pid returns the redis-server process id, or 0 once it is down.
func (s *TLSServer) Pid() int { return s.srv.Pid() }

// waitReadyTLS polls addr over TLS until the server there answers INFO with
// p's pid.
func waitReadyTLS(p *proc, addr string, cfg *tls.Config, timeout time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: addr, TLSConfig: cfg, MaxRetries: -1, PoolSize: 1,
		DialTimeout: 250 * time.Millisecond, ReadTimeout: 250 * time.Millisecond, WriteTimeout: 250 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if p.exited() {
			return fmt.Errorf("%w before answering (%v)", errExited, p.err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		info, err := c.Info(ctx, "server").Result()
		cancel()
		last = err
		if err == nil {
			pid, _ := strconv.Atoi(parseInfo(info)["process_id"])
			if pid == p.pid() {
				return nil
			}
			last = fmt.Errorf("port is answered by pid %d, not by ours (%d)", pid, p.pid())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no answer over TLS within %v: %v", timeout, last)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// writeTestCerts writes a new CA (ca.crt) and a certificate for 127.0.0.1
// that it signed (redis.crt, redis.key) into dir, and returns a pool
// holding the CA alone.
func writeTestCerts(dir string) (*x509.CertPool, error) {
	now := time.Now()
	ca, caKey, err := newTestCA(now)
	if err != nil {
		return nil, err
	}
	der, keyDER, err := newServerCert(now, ca, caKey)
	if err != nil {
		return nil, err
	}
	for _, f := range []struct {
		name, kind string
		der        []byte
		perm       os.FileMode
	}{
		{"ca.crt", "CERTIFICATE", ca.Raw, 0o644},
		{"redis.crt", "CERTIFICATE", der, 0o644},
		{"redis.key", "PRIVATE KEY", keyDER, 0o600},
	} {
		b := pem.EncodeToMemory(&pem.Block{Type: f.kind, Bytes: f.der})
		if err := os.WriteFile(filepath.Join(dir, f.name), b, f.perm); err != nil {
			return nil, err
		}
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	return roots, nil
}

// newTestCA makes a self-signed CA valid from an hour before now to a day
// after it.
func newTestCA(now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "redistest CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	return ca, key, nil
}

// newServerCert makes a server certificate for 127.0.0.1 that ca signed,
// and its key, both in DER.
func newServerCert(now time.Time, ca *x509.Certificate, caKey *ecdsa.PrivateKey) (der, keyDER []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if der, err = x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey); err != nil {
		return nil, nil, err
	}
	if keyDER, err = x509.MarshalPKCS8PrivateKey(key); err != nil {
		return nil, nil, err
	}
	return der, keyDER, nil
}

// serial returns a random certificate serial number.
func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127)) // crypto/rand never fails
	return n
}
