"""ferry-deep-ep: the module `deep_ep` (DeepEP's Python API) on ferry,
provided through an import hook (ferry_deep_ep._hook, installed by the
file ferry-deep-ep.pth) instead of files named deep_ep/, so that a real
DeepEP installed beside it is never overwritten: with both present,
`import deep_ep` asks for a choice (FERRY_DEEP_EP=ferry or =deepep), and
uninstalling ferry-deep-ep leaves DeepEP as it was."""
