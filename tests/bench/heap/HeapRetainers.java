import java.io.File;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.netbeans.lib.profiler.heap.GCRoot;
import org.netbeans.lib.profiler.heap.Heap;
import org.netbeans.lib.profiler.heap.HeapFactory;
import org.netbeans.lib.profiler.heap.Instance;
import org.netbeans.lib.profiler.heap.JavaClass;
import org.netbeans.lib.profiler.heap.ObjectArrayInstance;
import org.netbeans.lib.profiler.heap.ObjectFieldValue;

/**
 * What a heap dump's instances of some classes cost, and who keeps them alive.
 *
 * <p>For each class named: the chains from a GC root to its instances (a sample of
 * {@link #SAMPLE}, spread over the heap), grouped by their first {@code DEPTH} steps from
 * the root, each a class and the field that holds the next. Then each class's retained
 * sizes (what freeing an instance would free, from the dominator tree), and the heap's
 * biggest objects by retained size. Usage (a single-file program):
 *
 * <pre>java -Xmx8g -cp 'tests/bench/heap/lib/*' tests/bench/heap/HeapRetainers.java DUMP DEPTH CLASS...</pre>
 *
 * <p>With {@code -DchainsOnly=true}, only the chains (the retained sizes take most of the time).
 */
public class HeapRetainers {
    private static final int SAMPLE = 3000; // instances followed to a root, per class

    public static void main(String[] args) throws Exception {
        if (args.length < 3) {
            System.err.println("usage: HeapRetainers DUMP DEPTH CLASS...");
            System.exit(2);
        }
        // The library's index of an earlier run lacks what retained sizes need: start afresh.
        File index = new File(args[0] + ".nbcache");
        File[] files = index.listFiles();
        for (File f : files == null ? new File[0] : files) f.delete();
        index.delete();
        Heap heap = HeapFactory.createHeap(new File(args[0]));
        int depth = Integer.parseInt(args[1]);
        List<JavaClass> classes = new ArrayList<>();
        for (int a = 2; a < args.length; a++) {
            JavaClass found = heap.getJavaClassByName(args[a]);
            if (found == null) System.out.println("no class " + args[a]);
            else classes.add(found);
        }
        for (JavaClass cls : classes) chains(heap, cls, depth); // computes the references
        if (Boolean.getBoolean("chainsOnly")) return; // the dominator tree takes longest
        for (JavaClass cls : classes) retained(cls); // then the dominator tree
        System.out.println("biggest objects by retained size:");
        for (Object o : heap.getBiggestObjectsByRetainedSize(20)) {
            Instance i = (Instance) o;
            System.out.printf("  %8.1f MB %s%n", i.getRetainedSize() / 1e6, i.getJavaClass().getName());
        }
    }

    private static void retained(JavaClass cls) {
        List<Long> sizes = new ArrayList<>();
        for (Object o : cls.getInstances()) sizes.add(((Instance) o).getRetainedSize());
        Collections.sort(sizes);
        long sum = sizes.stream().mapToLong(Long::longValue).sum();
        long median = sizes.isEmpty() ? 0 : sizes.get(sizes.size() / 2);
        System.out.printf("%s: %d instances, retained %.1f MB in all, median %.2f MB%n",
            cls.getName(), sizes.size(), sum / 1e6, median / 1e6);
    }

    private static void chains(Heap heap, JavaClass cls, int depth) {
        List<?> instances = cls.getInstances();
        System.out.println("=== " + cls.getName() + ": " + instances.size() + " instances");
        Map<String, Integer> grouped = new HashMap<>();
        int every = Math.max(1, instances.size() / SAMPLE); // spread over the heap
        for (int n = 0; n < instances.size(); n += every) {
            Object o = instances.get(n);
            List<String> steps = new ArrayList<>();
            Instance at = (Instance) o;
            while (!at.isGCRoot() && steps.size() < 1000) {
                Instance holder = at.getNearestGCRootPointer();
                if (holder == null) break;
                steps.add(step(holder, at));
                at = holder;
            }
            GCRoot root = at.isGCRoot() ? heap.getGCRoot(at) : null;
            Collections.reverse(steps);
            List<String> shown = new ArrayList<>();
            for (String step : steps) {
                String general = step.replaceAll("\\$\\d+", "\\$N");
                if (shown.isEmpty() || !shown.get(shown.size() - 1).equals(general)) shown.add(general);
            }
            String key = (root == null ? "(no root)" : root.getKind() + " " + at.getJavaClass().getName())
                + "\n    " + String.join("\n    ", shown.subList(0, Math.min(depth, shown.size())));
            grouped.merge(key, 1, Integer::sum);
        }
        grouped.entrySet().stream()
            .sorted((x, y) -> y.getValue() - x.getValue())
            .limit(8)
            .forEach(e -> System.out.println(e.getValue() + " x " + e.getKey()));
    }

    /** "HolderClass.field" for the field of {@code holder} that refers to {@code held}. */
    private static String step(Instance holder, Instance held) {
        String field = holder instanceof ObjectArrayInstance ? "[]" : "?";
        for (Object o : holder.getFieldValues()) {
            if (o instanceof ObjectFieldValue v && v.getInstance() != null
                    && v.getInstance().getInstanceId() == held.getInstanceId()) {
                field = v.getField().getName();
                break;
            }
        }
        return holder.getJavaClass().getName() + "." + field;
    }
}
