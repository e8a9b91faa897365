"""The probe's runtime: turning it on (`entry`, `runtime`), wrapping the engine's methods (`hooks`,
`patching`, checked by `verify`) and its shutdown. It loads an engine's roles by name, so it imports
no engine. Kept empty: the start-up hook imports `core.entry` in every interpreter."""
