"""Diagnostics: environment checks, collective tests, profiles, watchdogs."""
