"""Adapters that put spechead's drafters and heads inside other serving engines.

Nothing else in spechead imports this package: each adapter depends on spechead and on its engine, never
the other way round, so spechead installs and tests without any of those engines.
"""
