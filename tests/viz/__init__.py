"""Tests for pipe.viz, one file per module."""
