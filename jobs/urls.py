from django.urls import include, path
from rest_framework.routers import DefaultRouter

from jobs.fleet import api as fleet_api, views as fleet_views
from jobs.runs import api as runs_api, views as runs_views
from jobs.scheduling import api as scheduling_api, views as scheduling_views
from jobs.access import api as api_auth
from jobs.planning import api as api_calibration, api as api_knowledge, api as api_plan, views as views_knowledge
from jobs.bundles import api as api_code
from jobs.telemetry import views as views_relay

router = DefaultRouter()
router.register("jobs", runs_api.JobViewSet, basename="api-job")
router.register("nodes", fleet_api.NodeViewSet, basename="api-node")

urlpatterns = [
    path("", runs_views.overview, name="overview"),
    path("jobs/", runs_views.job_list, name="job-list"),
    path("jobs/new/", runs_views.job_new, name="job-new"),
    path("jobs/<int:pk>/", runs_views.job_detail, name="job-detail"),
    path("jobs/<int:pk>/cancel/", runs_views.job_cancel, name="job-cancel"),
    path("jobs/<int:pk>/annotate/", runs_views.job_annotate, name="job-annotate"),
    path("nodes/", fleet_views.node_list, name="node-list"),
    path("nodes/control-plane/", fleet_views.control_plane, name="control-plane"),
    path("quotas/", scheduling_views.quota_list, name="quota-list"),
    path("knowledge/", views_knowledge.knowledge_page, name="knowledge"),
    path("relay/dead-letters/", views_relay.dead_letters, name="relay-dead-letters"),
    path("api/v1/auth/token/", api_auth.AuthTokenView.as_view(), name="api-auth-token"),
    path("api/v1/quotas/", scheduling_api.QuotaView.as_view(), name="api-quotas"),
    path("api/v1/knowledge/", api_knowledge.KnowledgeView.as_view(), name="api-knowledge"),
    path("api/v1/code/", api_code.CodeUploadView.as_view(), name="api-code"),
    path("api/v1/plan/", api_plan.PlanView.as_view(), name="api-plan"),
    path("api/v1/code/<str:digest>/", api_code.CodeDetailView.as_view(), name="api-code-detail"),
    path("api/v1/calibrations/", api_calibration.CalibrationView.as_view(), name="api-calibrations"),
    path("api/v1/", include(router.urls)),
]
