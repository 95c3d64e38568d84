"""The library's command-line tools (`longstraw step`, `plan`, `state-size`): measurements and estimates built on
the library, not part of it; nothing in `longstraw` imports them except the CLI."""
