"""yatt_ray."""
