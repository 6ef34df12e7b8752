"""Drop-ins that give other trainers turbogrpo's shared-prefix training forward (import them by name:
``turbogrpo.integrations.trl`` needs TRL, which turbogrpo itself does not)."""
