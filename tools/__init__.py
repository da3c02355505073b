"""Command-line tools built on graphrunner's public API: `inspect` and `bench`."""
