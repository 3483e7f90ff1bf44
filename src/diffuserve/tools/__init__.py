"""Tools around the product (documentation generators); nothing in the serving path imports them."""
