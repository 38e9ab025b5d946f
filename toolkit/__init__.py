"""The toolkit's plumbing, below every other package: one-line errors (errors), the entry-point runner (entry),
config composition (config) and typed option schemas (schema), files written whole or not at all and locks (disk),
and the provenance every written result carries (provenance). It imports no other package of the toolkit."""
