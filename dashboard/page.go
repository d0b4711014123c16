package dashboard

import (
	"bytes"
	"cmp"
	_ "embed"
	"encoding/json"
	"html/template"
	"net/http"
)

// page.html is the page: the server renders it, figures included, and
// its script redraws the quotas from ?format=json with the same markup.
// Its classes and data attributes name each quota and figure, for tests
// and scrapers: section.quota[data-quota], tr.rule[data-rule],
// td.used / td.booked / td.limit[data-limit][data-configured][data-capped],
// span.pause[data-paused-by], tr.key[data-hash].
//
//go:embed page.html
var pageHTML string

var page = template.Must(template.New("page").Funcs(template.FuncMap{
	"level":  level,
	"prefix": func(p string) string { return cmp.Or(p, "throttle") },
}).Parse(pageHTML))

// level names how full a bar is, for its colour.
func level(fill int) string {
	switch {
	case fill >= 100:
		return "full"
	case fill >= 80:
		return "hi"
	}
	return "ok"
}

// The page's Content-Security-Policy: nothing is loaded from elsewhere,
// and the script fetches the page's own data only.
const contentPolicy = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; connect-src 'self'; img-src data:"

// writePage renders s as the page, whole before a byte is sent, so that a
// failed render is a 500, not half a page.
func writePage(w http.ResponseWriter, status int, s *snapshot) {
	var b bytes.Buffer
	if err := page.Execute(&b, s); err != nil {
		http.Error(w, "dashboard: rendering the page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Content-Security-Policy", contentPolicy)
	w.WriteHeader(status)
	_, _ = w.Write(b.Bytes())
}

// writeJSON writes s as JSON.
func writeJSON(w http.ResponseWriter, status int, s *snapshot) {
	b, err := json.Marshal(s)
	if err != nil {
		http.Error(w, "dashboard: encoding the data: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
