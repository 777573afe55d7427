//! The kernel's `sort()` (`lib/sort.c`): a bottom-up heapsort, not stable. The hist file
//! lists entries in the order it leaves them, so entries whose sort keys are equal (two
//! keys with the same hitcount) come out in an order only this algorithm reproduces.

use std::cmp::Ordering;

/// Sorts `items` as `sort(base, num, size, cmp, NULL)` does.
pub fn sort<T>(items: &mut [T], mut cmp: impl FnMut(&T, &T) -> Ordering) {
    let mut n = items.len();
    let mut a = n / 2;
    if a == 0 {
        return;
    }
    let parent = |i: usize| (i - 1) / 2;
    loop {
        if a > 0 {
            // Building the heap: sift down element a - 1.
            a -= 1;
        } else {
            n -= 1;
            if n == 0 {
                break;
            }
            // Sorting: the root (the largest) goes to the end.
            items.swap(0, n);
        }
        // Find the path to a leaf, one compare per level, the larger child each time...
        let mut b = a;
        let (mut c, mut d);
        loop {
            c = 2 * b + 1;
            d = c + 1;
            if d >= n {
                break;
            }
            b = if cmp(&items[c], &items[d]).is_ge() { c } else { d };
        }
        if d == n {
            b = c;
        }
        // ...then back up to where element a belongs, and rotate it into place.
        while b != a && cmp(&items[a], &items[b]).is_ge() {
            b = parent(b);
        }
        let place = b;
        while b != a {
            b = parent(b);
            items.swap(b, place);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_sorts() {
        let mut v: Vec<u32> = (0..200).map(|i| (i * 7919) % 211).collect();
        sort(&mut v, |a, b| a.cmp(b));
        assert!(v.windows(2).all(|w| w[0] <= w[1]), "{v:?}");
        let mut one = [5];
        sort(&mut one, |a: &i32, b| a.cmp(b));
        assert_eq!(one, [5]);
    }

    /// The order of equal elements is the kernel's: the expected orders are what a C
    /// program running `lib/sort.c`'s `sort_r` printed for the same input.
    #[test]
    fn equal_elements_end_up_where_the_kernels_heapsort_puts_them() {
        let mut v = [(1, 'a'), (0, 'b'), (1, 'c'), (0, 'd'), (1, 'e'), (0, 'f')];
        sort(&mut v, |a, b| a.0.cmp(&b.0));
        assert_eq!(v, [(0, 'f'), (0, 'b'), (0, 'd'), (1, 'c'), (1, 'e'), (1, 'a')]);

        let mut w: Vec<(u32, u32)> = (0..40).map(|i| ((i * 7) % 3, i)).collect();
        sort(&mut w, |a, b| a.0.cmp(&b.0));
        let tags: Vec<u32> = w.iter().map(|e| e.1).collect();
        assert_eq!(
            tags,
            [
                15, 39, 0, 36, 6, 27, 12, 24, 21, 9, 33, 3, 18, 30, 28, 13, 25, 10, 19, 4, 37, 22, 1, 34, 16, 31, 7,
                29, 14, 26, 23, 11, 5, 2, 20, 38, 35, 17, 8, 32
            ]
        );
    }
}
