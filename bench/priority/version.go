package main

import "github.com/throttlekit/throttle"

// A version is one behaviour of the library that the program measures: a
// row of each table.
type version struct {
	// name is the version's row label and its name for -versions.
	name string
	// about says in a sentence what the version does, above the tables.
	about string
	// options returns the Options of each of a run's limiters in mode.
	options func(mode throttle.Mode) throttle.Options
}

// versions are the versions the program knows, in the order of the rows.
// FCFS is the library as it is; a fleet-wide priority mode, once it exists,
// is another entry whose options turn it on.
var versions = []version{
	{
		name: "FCFS",
		about: "the library today, first come first served across the fleet: a call books the earliest free slot; " +
			"Priority orders only the local queue of a limiter in Queue mode",
		options: func(mode throttle.Mode) throttle.Options { return throttle.Options{Mode: mode} },
	},
}

// versionNames returns the names of versions, in order.
func versionNames() []string {
	names := make([]string, len(versions))
	for i, v := range versions {
		names[i] = v.name
	}
	return names
}
