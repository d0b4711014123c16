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
var versions = []version{
	{
		name: "FCFS",
		about: "first come first served across the fleet (Options.ArrivalOrder): a call books the earliest free slot; " +
			"Priority orders only the local queue of a limiter in Queue mode",
		options: func(mode throttle.Mode) throttle.Options {
			return throttle.Options{Mode: mode, ArrivalOrder: true}
		},
	},
	{
		name: "shares",
		about: "the default: a full quota holds, in every replica, the share that higher priorities and lighter keys " +
			"booked in the last window and a half (the classes of lua/acquire.lua)",
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
