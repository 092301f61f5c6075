"""Generated code for the ``deltaserve.*`` proto packages."""
