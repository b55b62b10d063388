module singleton.dev/testbed/pause

go 1.24
