"""The wheel, the layout's contracts, the docs' links, the examples, the demo and scripts/test."""
