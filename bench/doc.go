// Package bench holds benchmarks of throttle against a real redis-server,
// with github.com/go-redis/redis_rate/v10 as the baseline. It is a separate
// module so that the library's go.mod does not carry the baseline's
// dependencies. Everything lives in _test.go files; see README.md.
package bench
