"""Tests of the cluster layer: pure state machines and real multi-node clusters."""
