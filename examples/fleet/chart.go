package main

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
)

// Chart geometry, in SVG user units.
const (
	chartWidth  = 960
	panelHeight = 300
	plotLeft    = 70
	plotRight   = 790 // the legend sits to its right
	plotTop     = 48  // from the top of a panel
	plotBottom  = 250 // from the top of a panel
)

const (
	colorAccepted = "#4878b0"
	colorRejected = "#d0443e"
	colorCap      = "#222222"
	colorGrid     = "#e4e4e4"
)

// writeChart writes the SVG of the runs to path.
func writeChart(path string, runs []Result) error {
	var b bytes.Buffer
	renderChart(&b, runs)
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		return fmt.Errorf("write chart: %w", err)
	}
	return nil
}

// renderChart draws one panel per run, stacked and on the same scale: the
// calls the vendor accepted each second, the 429s on top of them, and the
// cap as a dashed line.
func renderChart(w io.Writer, runs []Result) {
	seconds, top := 1, 1.0
	for _, r := range runs {
		seconds = max(seconds, len(r.Seconds), int(math.Ceil(r.Ran.Seconds())))
		top = max(top, 1.25*capPerSecond(r))
		for _, s := range r.Seconds {
			top = max(top, 1.1*float64(s.Accepted+s.Rejected))
		}
	}
	step := niceStep(top / 5)
	top = math.Ceil(top/step) * step

	height := panelHeight * max(1, len(runs))
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		chartWidth, height, chartWidth, height)
	fmt.Fprintf(w, `<rect width="%d" height="%d" fill="white"/>`+"\n", chartWidth, height)
	for i, r := range runs {
		fmt.Fprintf(w, `<g transform="translate(0,%d)">`+"\n", i*panelHeight)
		renderPanel(w, r, seconds, top, step)
		fmt.Fprintln(w, "</g>")
	}
	fmt.Fprintln(w, "</svg>")
}

func renderPanel(w io.Writer, r Result, seconds int, top, step float64) {
	x := func(s float64) float64 { return plotLeft + s*(plotRight-plotLeft)/float64(seconds) }
	y := func(v float64) float64 { return plotBottom - v*(plotBottom-plotTop)/top }

	title := fmt.Sprintf("%s: %d × 429, %s of the cap used", r.Title, r.OverCap, percent(r.Fleet.Utilization))
	fmt.Fprintf(w, `<text x="%d" y="26" font-size="15" font-weight="bold">%s</text>`+"\n", plotLeft, esc(title))

	// Grid and y axis.
	decimals := max(0, int(math.Ceil(-math.Log10(step))))
	for i := 0; float64(i)*step <= top+step/2; i++ {
		v := float64(i) * step
		fmt.Fprintf(w, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="%s"/>`+"\n", plotLeft, y(v), plotRight, y(v), colorGrid)
		fmt.Fprintf(w, `<text x="%d" y="%.1f" text-anchor="end" dominant-baseline="middle">%.*f</text>`+"\n", plotLeft-6, y(v), decimals, v)
	}
	mid := (plotTop + plotBottom) / 2
	fmt.Fprintf(w, `<text x="18" y="%d" text-anchor="middle" transform="rotate(-90 18 %d)">calls per second</text>`+"\n", mid, mid)

	// Bars: accepted at the bottom, 429s stacked on top.
	barW := 0.8 * (x(1) - x(0))
	for s, sec := range r.Seconds {
		left := x(float64(s)) + 0.1*(x(1)-x(0))
		acc, rej := float64(sec.Accepted), float64(sec.Rejected)
		if acc > 0 {
			fmt.Fprintf(w, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%ds: %d accepted</title></rect>`+"\n",
				left, y(acc), barW, y(0)-y(acc), colorAccepted, s, sec.Accepted)
		}
		if rej > 0 {
			fmt.Fprintf(w, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%ds: %d answered 429</title></rect>`+"\n",
				left, y(acc+rej), barW, y(acc)-y(acc+rej), colorRejected, s, sec.Rejected)
		}
	}

	// The cap.
	c := capPerSecond(r)
	fmt.Fprintf(w, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="%s" stroke-width="2" stroke-dasharray="8 5"/>`+"\n",
		plotLeft, y(c), plotRight, y(c), colorCap)

	// X axis.
	fmt.Fprintf(w, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s"/>`+"\n", plotLeft, plotBottom, plotRight, plotBottom, colorCap)
	fmt.Fprintf(w, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s"/>`+"\n", plotLeft, plotTop, plotLeft, plotBottom, colorCap)
	xStep := int(max(1, niceStep(float64(seconds)/12)))
	for s := 0; s <= seconds; s += xStep {
		fmt.Fprintf(w, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="%s"/>`+"\n", x(float64(s)), plotBottom, x(float64(s)), plotBottom+5, colorCap)
		fmt.Fprintf(w, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", x(float64(s)), plotBottom+19, s)
	}
	fmt.Fprintf(w, `<text x="%d" y="%d" text-anchor="middle">seconds since the fleet started</text>`+"\n", (plotLeft+plotRight)/2, plotBottom+38)

	// Legend.
	lx, ly := plotRight+18, plotTop+4
	fmt.Fprintf(w, `<rect x="%d" y="%d" width="14" height="14" fill="%s"/>`+"\n", lx, ly, colorAccepted)
	fmt.Fprintf(w, `<text x="%d" y="%d">accepted (200)</text>`+"\n", lx+20, ly+11)
	fmt.Fprintf(w, `<rect x="%d" y="%d" width="14" height="14" fill="%s"/>`+"\n", lx, ly+24, colorRejected)
	fmt.Fprintf(w, `<text x="%d" y="%d">over the cap (429)</text>`+"\n", lx+20, ly+35)
	fmt.Fprintf(w, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" stroke-dasharray="8 5"/>`+"\n", lx, ly+55, lx+14, ly+55, colorCap)
	fmt.Fprintf(w, `<text x="%d" y="%d">%s</text>`+"\n", lx+20, ly+59, esc(fmt.Sprintf("cap: %d per %v", r.Limit, r.Window)))
}

// capPerSecond is the vendor's cap as an average rate.
func capPerSecond(r Result) float64 { return float64(r.Limit) / r.Window.Seconds() }

// niceStep rounds x up to 1, 2 or 5 times a power of ten.
func niceStep(x float64) float64 {
	if x <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(x)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= x {
			return m * p
		}
	}
	return 10 * p
}

func esc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s)) // a strings.Builder never fails
	return b.String()
}
