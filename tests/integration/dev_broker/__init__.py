"""The development broker: plain and secured."""
