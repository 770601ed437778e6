"""Helpers that several test modules share. No module here is a test module, so a test module imports only
these (never another test module), and pytest collects each test once, from the module that defines it."""
