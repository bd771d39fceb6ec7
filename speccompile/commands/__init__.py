"""The command-line front ends: each module parses options, calls a library function and prints its result."""
