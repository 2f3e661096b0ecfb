"""The kstore command: bad configuration as one line, the commands on each driver."""
