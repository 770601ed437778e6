"""Envoy's protocols, translated to and from the admission core: the ext_proc servicer and its two
translators (inline.py, lean.py), the replies they build (messages.py), the lean profile's end reports
(accesslog.py) and their relay between replicas (relay.py).

Modules, by their path from this folder: Envoy's protocols, translated to and from the admission core:
`servicer.py` (`ExtProcServicer`: one `Exchange` per ext_proc stream, handed to its profile's translator; it
depends on the interfaces it declares, `Admitting` and `Translator`, never a concrete admission class),
`inline.py` (`InlineTranslator`, the inline profile), `lean.py` (`LeanTranslator`, the lean profile),
`messages.py` (the ext_proc replies built from verdicts, header and attribute reading); the two rows below are
the protocol's own too. Together: each stream's messages to its `Exchange` and each verdict to a reply, in the
inline or the lean profile; decides nothing and reads no phase or class (the lean translator writes the
`Forward`'s report ticket and metadata as they come); a translator talks to its `Exchange` alone.
"""
