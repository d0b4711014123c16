// Package mdtable prints Markdown tables with aligned columns, for the
// programs of this module that print their results.
package mdtable

import (
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// Write prints rows, the header first, as a Markdown table with aligned
// columns.
func Write(w io.Writer, rows [][]string) {
	widths := make([]int, len(rows[0]))
	for _, row := range rows {
		for i, cell := range row {
			widths[i] = max(widths[i], utf8.RuneCountInString(cell))
		}
	}
	line := func(cells []string) {
		var b strings.Builder
		b.WriteString("|")
		for i, cell := range cells {
			b.WriteString(" " + cell + strings.Repeat(" ", widths[i]-utf8.RuneCountInString(cell)) + " |")
		}
		fmt.Fprintln(w, b.String())
	}
	line(rows[0])
	rule := make([]string, len(widths))
	for i, n := range widths {
		rule[i] = strings.Repeat("-", n)
	}
	line(rule)
	for _, row := range rows[1:] {
		line(row)
	}
}
