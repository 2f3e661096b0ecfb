"""kstore.engine without a broker: partitions, failures, positions, the ledger's races, signals."""
