"""singletonctl: see and steer singleton groups from the command line."""
